"""Step time of the app's per-rank path (``run.fit.fit``) vs a plain torch loop doing the same math, same processes.

Run by hand: ``benchmarks/step_overhead.py --layout ddp fsdp tp pp --model tiny [--telemetry both] [--rounds 5]``.

For each layout, 2 ranks are started once (``lightning_dist.run.launch.launch``, one thread per rank); in those same
two processes the variants then run in turn for ``--rounds`` rounds (order rotated each round, no variant first):

- ``library on`` / ``library off``: ``lightning_dist.run.fit.fit(valid_run, callbacks=[StepClock])``, what the app
  runs on each rank, with its default callbacks (loss history, preemption, heartbeat, layout, and Telemetry when
  ``telemetry.enabled=true``). The config is composed from ``lightning_dist/conf`` as ``tests/helpers.py`` does:
  ``parallelism=<ddp|fsdp|tp|pp>``, no logger, checkpoints, validation, progress bar or report; the rest (gradient
  clipping at 1.0, log every 10 steps, comm tracking) as the app's defaults.
- ``plain``: no Lightning. The same ``GPT`` (``init_weights(seed)``), the same batches (the app's own
  ``TokenDataModule.build_dataloader`` for this data-parallel rank), AdamW + warmup/cosine from
  ``models/optim.py: adamw_with_schedule`` (fused, as the app's), ``clip_grad_norm_(1.0)``, ``scheduler.step``,
  ``zero_grad``. ddp: ``DDP(model)``; fsdp: ``fully_shard`` per block, then the GPT; tp: ``parallelize_module`` with
  ``gpt_tensor_parallel_plan`` and ``loss_parallel()``; pp: the GPT cut by hand into this rank's stage (the block
  split is the app's ``pipeline.balanced_split``, reused), a ``PipelineStage`` and the schedule class and microbatch
  count the app resolved (``1F1B``, 2 for ``conf/parallelism/pp.yaml``); the norm's squares are summed over the
  pipeline ranks (one all-reduce) before ``clip_grads_with_norm_``. It logs nothing and reads nothing back per step.

Models (``MODELS``, ``DATA``): ``tiny``, whose step is nearly all fixed host cost (tp=2 needs 2 kv heads, pp=2 two
blocks: the table prints the model each layout ran), and ``d256``.

Step time is start-to-start of consecutive batches on rank 0 (``on_train_batch_start`` / the top of the plain loop),
so it includes data loading and everything done between batches; the first ``--warmup`` steps are skipped. Per run
the median and the mean over the timed steps; the table gives the median over rounds of each. The median is the
"typical" step; the mean also counts what happens on one step in ``log_every_n_steps`` (logging, Telemetry's sampled
comm timing), so keep ``--steps`` a multiple of 10. ``paired`` = the median over rounds of the ratio within a round.
First/last-step losses (mean over ranks holding one) are printed: the variants must compute the same thing.
Results (2026-11-24, 2-core VM, 5 rounds): docs/benchmarks.md, "Per-step overhead and start-up".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import logging
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.run.launch import launch

CONF_DIR = Path(__file__).resolve().parents[1] / "lightning_dist" / "conf"
LAYOUTS = ("ddp", "fsdp", "tp", "pp")
#: model fields per size; the per-layout changes the layouts need are in ``model_overrides``.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
    "d256": {"d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8},
}
#: (global batch, seq_len) per size.
DATA: dict[str, tuple[int, int]] = {"tiny": (8, 32), "d256": (8, 128)}


@dataclass(frozen=True)
class Bench:
    """One layout and model, and how long each run is."""

    layout: str
    model: str
    warmup: int
    steps: int

    @property
    def num_batches(self) -> int:
        """Warmup + timed steps, plus one batch whose start closes the last timed step."""
        return self.warmup + self.steps + 1

    def model_overrides(self) -> dict[str, int]:
        fields = dict(MODELS[self.model])
        if self.layout == "tp":  # tp=2 shards the kv heads
            fields["n_kv_heads"] = max(2, fields["n_kv_heads"])
        if self.layout == "pp":  # pp=2 needs a block per stage
            fields["n_layers"] = max(2, fields["n_layers"])
        return fields

    def describe_model(self) -> str:
        m = self.model_overrides()
        batch, seq = DATA[self.model]
        return f"d{m['d_model']} L{m['n_layers']} h{m['n_heads']}/{m['n_kv_heads']}, {batch}x{seq}"

    def overrides(self, telemetry: bool) -> list[str]:
        """Command-line overrides of ``lightning-dist-train`` for this run."""
        batch, seq = DATA[self.model]
        model = [f"model.{k}={v}" for k, v in self.model_overrides().items()]
        # One epoch holds every step: an epoch boundary inside the timed steps would cost the library one step.
        return [
            "logger=none", "trainer.enable_checkpointing=false", "trainer.num_sanity_val_steps=0",
            "trainer.limit_val_batches=0", "telemetry.report=false", "trainer.enable_progress_bar=false",
            f"parallelism={self.layout}", f"telemetry.enabled={str(telemetry).lower()}",
            f"trainer.max_steps={self.num_batches}", *model, "model.max_seq_len=256",
            f"data.global_batch_size={batch}", f"data.seq_len={seq}",
            f"data.num_train_samples={(self.num_batches + 1) * batch}", "data.num_val_samples=16",
        ]  # fmt: skip


def compose_valid_run(overrides: list[str], output_dir: str) -> Any:
    """The checked run (``ValidRun``) that ``lightning-dist-train <overrides>`` hands every rank."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.config.schema import register_configs, to_train_config
    from lightning_dist.config.validate import validate

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(compose(config_name="train", overrides=overrides))
    cfg.output_dir = output_dir
    return validate(cfg)


@dataclass
class RankResult:
    """Start time of every step and this rank's loss of every step (empty where the rank holds no loss)."""

    starts: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def _local(loss: Tensor) -> Tensor:
    """A loss-parallel loss is a replicated DTensor: its local tensor is the value (no collective)."""
    return loss.to_local() if hasattr(loss, "to_local") else loss


class StepClock(pl.Callback):
    """Start time of every training batch; the losses are kept as tensors and read once fit has returned."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.losses: list[Tensor] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())


def run_library(valid: Any) -> RankResult:
    """One run of the app's rank function, ``fit``, with a :class:`StepClock` added."""
    from lightning_dist.run.fit import fit

    clock = StepClock()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # layout and telemetry summaries
        fit(copy.deepcopy(valid), callbacks=[clock])  # a fresh copy: fit builds its mesh into the run's dims
    return RankResult(clock.starts, [float(_local(loss)) for loss in clock.losses])


def run_lightning(valid: Any) -> RankResult:
    """``--lightning`` (ddp): Lightning alone: its ``DDPStrategy``, the app's module and data with no logging, no
    callbacks but the clock, Lightning's own clipping (1.0). Separates Lightning's per-step cost from ours."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dist.config.build import build_datamodule, build_module

    cfg = copy.deepcopy(valid.cfg)
    module, datamodule, clock = build_module(cfg), build_datamodule(cfg), StepClock()
    module.training_step = lambda batch, batch_idx: module.compute_loss(batch)  # the same math, nothing logged
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=cfg.trainer.max_steps, gradient_clip_val=1.0, logger=False, callbacks=[clock],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    return RankResult(clock.starts, [float(_local(loss)) for loss in clock.losses])


_MESHES: dict[str, Any] = {}


def _mesh(name: str) -> Any:
    """A 1-D mesh over both ranks, built once per process (new process groups every round would pile up)."""
    from torch.distributed.device_mesh import init_device_mesh

    if name not in _MESHES:
        _MESHES[name] = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))
    return _MESHES[name]


def run_plain(valid: Any, layout: str) -> RankResult:
    """One run of the plain loop: torch APIs only, the same model, batches, optimizer and clipping as the app."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from lightning_dist.data import TokenDataModule
    from lightning_dist.models.gpt import GPT
    from lightning_dist.models.gpt_parallel import gpt_tensor_parallel_plan
    from lightning_dist.models.loss import token_loss
    from lightning_dist.models.optim import adamw_with_schedule
    from lightning_dist.parallel.pipeline import PipelineSpec as Spec
    from lightning_dist.parallel.pipeline import balanced_split, block_costs

    cfg = valid.cfg
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg.model)
    model.init_weights(cfg.seed)
    dp_size, dp_rank = (world, rank) if layout in ("ddp", "fsdp") else (1, 0)
    loader = TokenDataModule(cfg.data, seed=cfg.seed).build_dataloader("train", dp_size, dp_rank)
    context = contextlib.nullcontext
    schedule, first, last = None, True, True
    if layout == "ddp":
        model = DistributedDataParallel(model)
    elif layout == "fsdp":
        for block in model.layers.values():
            fully_shard(block, mesh=_mesh("dp_shard"))
        fully_shard(model, mesh=_mesh("dp_shard"))
    elif layout == "tp":
        parallelize_module(model, _mesh("tp"), gpt_tensor_parallel_plan(""))
        context = loss_parallel
    elif layout == "pp":
        # The app's split (by parameter count, embedding and head included), then this rank's stage cut by hand.
        spec = Spec(model_attr="", blocks_attr="layers", first=("tok_emb",), last=("norm", "head"))
        keys, costs = block_costs(model, spec)
        mine = {keys[i] for i in balanced_split(costs, world)[rank]}
        for key in [k for k in keys if k not in mine]:
            del model.layers[key]
        first, last = rank == 0, rank == world - 1
        if not first:
            model.tok_emb = None
        if not last:
            model.norm, model.head = None, None
        stage = PipelineStage(model, rank, world, torch.device("cpu"), group=dist.group.WORLD)
        # The schedule and microbatch count the app resolved from the config (its parallelism options).
        schedule_cls = get_schedule_class(valid.parallelism.pipeline.schedule)
        microbatches = valid.parallelism.pipeline.num_microbatches(world)
        schedule = schedule_cls(stage, n_microbatches=microbatches, loss_fn=token_loss, scale_grads=True)
    opt = adamw_with_schedule(model.named_parameters(), cfg.optim, lambda name, p: "emb" in name, cfg.trainer.max_steps)
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    params = [p for p in model.parameters() if p.requires_grad]
    result, losses = RankResult(), []
    model.train()
    for inputs, targets in itertools.islice(loader, cfg.trainer.max_steps):
        result.starts.append(time.perf_counter())
        if schedule is None:
            with context():
                loss = token_loss(model(inputs), targets)
                loss.backward()
            losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, cfg.trainer.gradient_clip_val, foreach=True)
        else:
            step_losses: list[Tensor] | None = [] if last else None
            if first:
                schedule.step(inputs, target=targets if last else None, losses=step_losses)
            else:
                schedule.step(target=targets if last else None, losses=step_losses)
            if step_losses is not None:
                losses.append(torch.stack([loss.detach() for loss in step_losses]).mean())
            grads = [p.grad for p in params if p.grad is not None]
            squares = torch.nn.utils.get_total_norm(grads, foreach=True).square()
            dist.all_reduce(squares)  # a stage holds part of the model: the norm is over both stages
            torch.nn.utils.clip_grads_with_norm_(params, cfg.trainer.gradient_clip_val, squares.sqrt(), foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    result.losses = [float(_local(loss)) for loss in losses]
    return result


def _quiet() -> None:
    """Keep Lightning's start-up messages out of the table."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_dist"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def run_rank(bench: Bench, variants: dict[str, Any], rounds: int) -> dict[str, list[RankResult]]:
    """One rank: every variant once per round, the order rotated each round; ``variants``: name -> ValidRun."""
    _quiet()
    names = list(variants)
    results: dict[str, list[RankResult]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            valid = variants[name]
            if name in ("plain", "lightning"):
                result = run_plain(valid, bench.layout) if name == "plain" else run_lightning(valid)
            else:
                result = run_library(valid)
            results[name].append(result)
            gc.collect()  # the previous run's model, optimizer and DDP reducer, outside anyone's timed steps
            dist.barrier()
    return results


# --------------------------------------------------------------------------------------------------- driver
@dataclass
class Measured:
    """Per variant: each round's median and mean ms/step (rank 0), and the step losses of the first round."""

    bench: Bench
    medians: dict[str, list[float]]
    means: dict[str, list[float]]
    losses: dict[str, list[float]]

    def median(self, variant: str, stat: str = "median") -> float:
        return statistics.median((self.medians if stat == "median" else self.means)[variant])

    def paired(self, a: str, b: str, stat: str = "median") -> float:
        """Median over rounds of ``a / b`` within a round."""
        per_round = self.medians if stat == "median" else self.means
        return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))

    def paired_diff(self, a: str, b: str, stat: str = "mean") -> float:
        """Median over rounds of ``a - b`` (ms) within a round."""
        per_round = self.medians if stat == "median" else self.means
        return statistics.median(x - y for x, y in zip(per_round[a], per_round[b]))


def global_losses(per_rank: list[RankResult]) -> list[float]:
    """Loss of the global batch per step: the mean over the ranks that hold one (tp / pp peers hold equal values)."""
    holding = [r.losses for r in per_rank if r.losses]
    return [statistics.fmean(step) for step in zip(*holding)]


def measure(
    layout: str, model: str, telemetry: str, rounds: int, steps: int, warmup: int, lightning: bool = False
) -> Measured:
    """Launch 2 ranks for ``layout`` and run the variants interleaved; ``telemetry``: on, off or both."""
    bench = Bench(layout, model, warmup, steps)
    modes = {"on": [True], "off": [False], "both": [True, False]}[telemetry]
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as out:
        variants = {f"library {'on' if on else 'off'}": compose_valid_run(bench.overrides(on), out) for on in modes}
        variants["plain"] = variants[next(iter(variants))]
        if lightning and layout == "ddp":
            variants["lightning"] = variants["plain"]
        per_rank = launch(run_rank, 2, bench, variants, rounds, threads_per_rank=1)
    medians: dict[str, list[float]] = {}
    means: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    for name in variants:
        for r in range(rounds):
            starts = per_rank[0][name][r].starts[warmup : warmup + steps + 1]
            times = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
            medians.setdefault(name, []).append(statistics.median(times))
            means.setdefault(name, []).append(statistics.fmean(times))
        losses[name] = global_losses([rank[name][0] for rank in per_rank])
    return Measured(bench, medians, means, losses)


def report(m: Measured) -> None:
    """The table of one layout: ms/step per variant, ratios to plain, telemetry on - off, losses."""
    b = m.bench
    print(f"\n{b.layout}, {b.model} ({b.describe_model()}), {len(m.medians['plain'])} rounds x {b.steps} steps")
    print("| variant     | median ms | mean ms | per-round medians ms           | /plain med | paired | /plain mean |")
    print("|-------------|-----------|---------|--------------------------------|------------|--------|-------------|")
    for v in m.medians:
        rounds = " ".join(f"{t:.1f}" for t in m.medians[v])
        print(
            f"| {v:<11} | {m.median(v):9.2f} | {m.median(v, 'mean'):7.2f} | {rounds:<30} "
            f"| {m.median(v) / m.median('plain'):10.3f} | {m.paired(v, 'plain'):6.3f} "
            f"| {m.median(v, 'mean') / m.median('plain', 'mean'):11.3f} |"
        )
    if "library on" in m.medians and "library off" in m.medians:
        diff, base = m.paired_diff("library on", "library off"), m.median("library off", "mean")
        print(f"telemetry on - off (paired, mean step): {diff:+.2f} ms = {diff / base * 100:+.1f}%")
    ref = m.losses["plain"]
    for v, losses in m.losses.items():
        print(f"loss {v:<11}: step 1 {losses[0]:.6f}, last step {losses[-1]:.6f}")
    spread = max(abs(a - b) for v in m.losses for a, b in zip(m.losses[v], ref))
    print(f"max |loss - plain| over all steps: {spread:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", nargs="+", choices=(*LAYOUTS, "all"), default=["ddp"])
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--telemetry", choices=("on", "off", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (a multiple of 10)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lightning", action="store_true", help="ddp: add Lightning's own DDPStrategy, no callbacks")
    args = parser.parse_args()
    layouts = LAYOUTS if "all" in args.layout else args.layout
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 2 ranks x 1 thread, gloo")
    for layout in layouts:
        report(measure(layout, args.model, args.telemetry, args.rounds, args.steps, args.warmup, args.lightning))


if __name__ == "__main__":
    main()
