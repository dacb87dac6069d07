"""Step time of TensorParallelStrategy vs a hand-written DTensor loop and vs Lightning's ModelParallelStrategy.

Run by hand: ``.venv/bin/python benchmarks/tp_overhead.py [--rounds 5] [--steps 30] [--tp 2] [--dp-shard 1]``.
The same GPT (``GPTModule`` / ``GPTConfig``, llama arch, float32), layout, data, global batch and optimizer
(``GPTModule.configure_optimizers``: AdamW + warmup/cosine LambdaLR) are trained three ways, each in freshly
launched ranks (``lightning_dist.launch.launch``):

- ``ours``: ``Trainer(strategy=TensorParallelStrategy(tp, dp_shard))``, sequence and loss parallelism on (the
  defaults). Its step includes what the strategy always does: the global gradient norm, logged as
  ``train/grad_norm`` every step (``parallel/clip.py``'s ``global_grad_norm``: a foreach norm over the DTensor
  gradients, 10 all-reduces here), besides ``GPTModule``'s own logging.
- ``(a) plain``: a plain PyTorch loop: ``init_device_mesh``, ``GPT.init_weights``, ``parallelize_module`` with
  ``gpt_tensor_parallel_plan`` and ``fully_shard`` (blocks, then the GPT) only when ``dp_shard > 1`` (what
  ``parallel/compose.py`` does; with ``dp_shard=1`` our strategy applies no FSDP either), then forward, loss and
  backward under ``loss_parallel()``, ``optimizer.step``, ``scheduler.step``, ``zero_grad``. No logging. It reads
  the batches through the sampler Lightning puts on training data (``DistributedSampler``, shuffled, seed 0).
- ``(b) lightning``: Lightning's ``ModelParallelStrategy(data_parallel_size=dp_shard, tensor_parallel_size=tp)``
  with a ``GPTModule`` subclass whose ``configure_model`` calls ``parallelize_module`` (and ``fully_shard``) by
  hand, and whose ``training_step`` / ``backward`` run under ``loss_parallel()``; it logs the loss like
  ``GPTModule`` (``sync_dist=True``) but computes no gradient norm.

The Lightning runs have no logger, checkpointing, progress bar, model summary, sanity check or validation, no
Telemetry callback and no gradient clipping. Step time is start-to-start of consecutive training batches on rank 0
(``time.perf_counter`` in ``on_train_batch_start``, or at the top of the plain loop), so it includes data loading
and everything the framework does between batches; the first ``--warmup`` steps are skipped. The variants run
interleaved (ours, a, b, ours, ...) for ``--rounds`` rounds so that machine drift hits all of them alike; the table
gives the median over rounds of each round's median (and mean) step time. Each rank gets one thread per core share.

The first- and last-step losses of the three variants are printed: they must agree (same init by seed and
parameter name, same batches), otherwise the comparison is not between equal computations.

``--no-norm-variant`` adds a fourth, diagnostic variant: ours with the per-step gradient norm switched off.

Results, readings and caveats (2026-11-23, 2-core CPU VM): ``docs/benchmarks.md``, "TP step time in full".
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.gpt_parallel import gpt_tensor_parallel_plan
from lightning_dist.models.module import GPTModule, warmup_cosine
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.clip import global_grad_norm
from lightning_dist.run.launch import launch


@dataclass(frozen=True)
class Bench:
    """Model, layout and run length shared by every variant."""

    tp: int
    dp_shard: int
    d_model: int
    layers: int
    heads: int
    vocab: int
    seq_len: int
    batch_size: int
    warmup: int
    steps: int
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.dp_shard

    @property
    def num_batches(self) -> int:
        """Warmup + timed steps, plus one batch whose start closes the last timed step."""
        return self.warmup + self.steps + 1

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            arch="llama",
            vocab_size=self.vocab,
            n_layers=self.layers,
            d_model=self.d_model,
            n_heads=self.heads,
            max_seq_len=self.seq_len,
        )

    def module(self, cls: type[GPTModule] = GPTModule) -> GPTModule:
        return cls(self.model_config(), OptimConfig(), max_steps=self.num_batches, init_seed=self.seed)

    def dataset(self) -> TensorDataset:
        """``num_batches`` global batches of random token ids, the same on every rank and variant."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.num_batches * self.batch_size, self.seq_len + 1)
        tokens = torch.randint(0, self.vocab, shape, generator=generator)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def dataloader(self) -> DataLoader:
        """Per-rank batches; Lightning swaps in a ``DistributedSampler`` over the data-parallel ranks."""
        return DataLoader(self.dataset(), batch_size=self.batch_size // self.dp_shard)


@dataclass
class RankResult:
    """Start time of every step and the rank-local loss of every step."""

    starts: list[float]
    losses: list[float]
    grad_norm_s: float | None = None
    """(a) only: time of one ``global_grad_norm`` call, the extra work our strategy does every step."""


def _quiet() -> None:
    """Keep Lightning's start-up messages out of the table."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*`validation_step` but have no.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=message)


def _scalar(loss: Tensor) -> float:
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


# ------------------------------------------------------------------------------------------------- Lightning
class StepClock(pl.Callback):
    """Start time and loss of every training batch."""

    def __init__(self) -> None:
        self.result = RankResult([], [])

    def on_train_batch_start(self, *args: Any) -> None:
        self.result.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.result.losses.append(_scalar(outputs["loss"]))


def _fit(bench: Bench, strategy: Any, module: GPTModule) -> RankResult:
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=bench.world_size,
        strategy=strategy,
        max_steps=bench.num_batches,
        logger=False,
        callbacks=[clock],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=None,
    )
    trainer.fit(module, bench.dataloader())
    return clock.result


def run_ours(bench: Bench) -> RankResult:
    """One rank of ``ours``: the Trainer with TensorParallelStrategy and the unmodified GPTModule."""
    from lightning_dist import TensorParallelStrategy

    _quiet()
    return _fit(bench, TensorParallelStrategy(tp=bench.tp, dp_shard=bench.dp_shard), bench.module())


def run_ours_no_norm(bench: Bench) -> RankResult:
    """Diagnostic (``--no-norm-variant``): ours with the per-step gradient norm switched off (a private hook)."""
    from lightning_dist import TensorParallelStrategy

    class NoGradNorm(TensorParallelStrategy):
        def _clip_and_log_grad_norm(self) -> None:
            pass

    _quiet()
    return _fit(bench, NoGradNorm(tp=bench.tp, dp_shard=bench.dp_shard), bench.module())


class HandParallelGPT(GPTModule):
    """What a user of Lightning's ModelParallelStrategy writes: the same plan, applied by hand."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()  # builds the GPT and initializes it from init_seed
        plan = gpt_tensor_parallel_plan("model.")
        parallelize_module(self, self.device_mesh["tensor_parallel"], plan)
        dp_mesh = self.device_mesh["data_parallel"]
        if dp_mesh.size() > 1:
            for block in self.model.layers.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        with loss_parallel():
            loss = self.compute_loss(batch)
        # Lightning's reduce takes plain tensors: the replicated DTensor loss is unwrapped first.
        self.log("train/loss", loss.full_tensor(), sync_dist=True)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        with loss_parallel():
            loss.backward(*args, **kwargs)


def run_lightning(bench: Bench) -> RankResult:
    """One rank of ``(b)``: the Trainer with Lightning's ModelParallelStrategy and ``HandParallelGPT``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    _quiet()
    strategy = ModelParallelStrategy(data_parallel_size=bench.dp_shard, tensor_parallel_size=bench.tp)
    return _fit(bench, strategy, bench.module(HandParallelGPT))


# ----------------------------------------------------------------------------------------------- plain loop
def run_plain(bench: Bench) -> RankResult:
    """One rank of ``(a)``: no Lightning, the parallelization and training step written out."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (bench.dp_shard, bench.tp), mesh_dim_names=("dp_shard", "tp"))
    model = GPT(bench.model_config())
    model.init_weights(bench.seed)
    if bench.tp > 1:
        parallelize_module(model, mesh["tp"], gpt_tensor_parallel_plan(""))
    if bench.dp_shard > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    # GPTModule.configure_optimizers, written out: AdamW with decay on matrices only, warmup + cosine schedule.
    cfg = OptimConfig()
    params = list(model.named_parameters())
    decay = [p for name, p in params if p.ndim >= 2 and "emb" not in name]
    no_decay = [p for name, p in params if not (p.ndim >= 2 and "emb" not in name)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg, bench.num_batches))
    # The sampler Lightning injects for training: shuffled with seed 0, one slice per data-parallel rank.
    sampler = DistributedSampler(bench.dataset(), num_replicas=bench.dp_shard, rank=mesh["dp_shard"].get_local_rank())
    sampler.set_epoch(0)
    data = DataLoader(sampler.dataset, batch_size=bench.batch_size // bench.dp_shard, sampler=sampler)
    result, losses = RankResult([], []), []
    model.train()
    for inputs, targets in data:
        result.starts.append(time.perf_counter())
        with loss_parallel():
            loss = GPTModule.loss_fn(model(inputs), targets)
            loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    result.losses = [_scalar(loss) for loss in losses]
    result.grad_norm_s = _time_grad_norm(model, data)
    return result


def _time_grad_norm(model: torch.nn.Module, data: DataLoader, calls: int = 20) -> float:
    """Median seconds of the strategy's ``global_grad_norm`` on this model's gradients (outside the timed steps)."""
    inputs, targets = next(iter(data))
    with loss_parallel():
        GPTModule.loss_fn(model(inputs), targets).backward()
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        global_grad_norm(model.parameters())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------- driver
RUNNERS = {"ours": run_ours, "(a) plain": run_plain, "(b) lightning": run_lightning, "ours no-norm": run_ours_no_norm}


def step_times(bench: Bench, result: RankResult) -> list[float]:
    """Seconds per timed step (start-to-start, warmup skipped)."""
    starts = result.starts[bench.warmup : bench.warmup + bench.steps + 1]
    return [b - a for a, b in itertools.pairwise(starts)]


def run_variant(variant: str, bench: Bench) -> list[RankResult]:
    """One run of ``variant`` in fresh ranks."""
    return launch(RUNNERS[variant], bench.world_size, bench)


def global_losses(per_rank: list[RankResult]) -> list[float]:
    """Loss of the global batch per step: the mean of the rank-local losses (tp peers hold equal values)."""
    return [statistics.fmean(step) for step in zip(*(r.losses for r in per_rank))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="global batch (sequences)")
    parser.add_argument(
        "--no-norm-variant", action="store_true", help="also run ours without its per-step gradient norm"
    )
    args = parser.parse_args()
    bench = Bench(
        tp=args.tp,
        dp_shard=args.dp_shard,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        vocab=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        warmup=args.warmup,
        steps=args.steps,
    )
    variants = ["ours", "(a) plain", "(b) lightning"] + (["ours no-norm"] if args.no_norm_variant else [])
    medians: dict[str, list[float]] = {v: [] for v in variants}
    means: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {}
    grad_norm_ms: list[float] = []
    for round_idx in range(args.rounds):
        for variant in variants:
            per_rank = run_variant(variant, bench)
            times = step_times(bench, per_rank[0])
            medians[variant].append(statistics.median(times) * 1e3)
            means[variant].append(statistics.fmean(times) * 1e3)
            losses.setdefault(variant, global_losses(per_rank))
            if per_rank[0].grad_norm_s is not None:
                grad_norm_ms.append(per_rank[0].grad_norm_s * 1e3)
            print(f"round {round_idx + 1}/{args.rounds} {variant}: median {medians[variant][-1]:.1f} ms", flush=True)
    print()
    print(
        f"GPT d_model={bench.d_model} layers={bench.layers} heads={bench.heads} vocab={bench.vocab} "
        f"seq_len={bench.seq_len}, global batch {bench.batch_size}, float32, AdamW; tp={bench.tp} "
        f"dp_shard={bench.dp_shard} on {bench.world_size} CPU ranks (gloo, torch {torch.__version__}); "
        f"{bench.steps} timed steps after {bench.warmup} warmup, {args.rounds} rounds interleaved"
    )
    report(medians, means, statistics.median(grad_norm_ms))
    report_losses(losses)


def report(medians: dict[str, list[float]], means: dict[str, list[float]], grad_norm_ms: float) -> None:
    """Step times per variant and the ratios of ours to the baselines.

    ``ours / x`` is the ratio of the medians over rounds; ``paired`` is the median over rounds of the ratio within a
    round (variants of one round ran back to back, so drift between rounds cancels).
    """
    median = {v: statistics.median(medians[v]) for v in medians}
    rounds = {v: " ".join(f"{t:.1f}" for t in medians[v]) for v in medians}
    width = max(20, *(len(r) for r in rounds.values()))
    print()
    header = "per-round medians ms"
    print(f"| variant       | median ms | mean ms | best round ms | {header:<{width}} | ours / x | paired |")
    print(f"|---------------|-----------|---------|---------------|-{'-' * width}-|----------|--------|")
    for v in medians:
        mean, best = statistics.median(means[v]), min(medians[v])
        paired = statistics.median(o / x for o, x in zip(medians["ours"], medians[v]))
        print(
            f"| {v:<13} | {median[v]:9.1f} | {mean:7.1f} | {best:13.1f} | {rounds[v]:<{width}} "
            f"| {median['ours'] / median[v]:8.3f} | {paired:6.3f} |"
        )
    print()
    print("targets: ours / (a) <= 1.05, ours / (b) <= 1.00")
    print(
        "ours computes the global gradient norm (logged as train/grad_norm) every step; (a) and (b) do not. One "
        f"global_grad_norm call: {grad_norm_ms:.2f} ms = {grad_norm_ms / median['(a) plain'] * 100:.1f}% of (a)'s step."
    )


def report_losses(losses: dict[str, list[float]]) -> None:
    """First- and last-step global-batch losses: equal computations give equal losses."""
    print()
    print("| variant       | loss step 1 | loss last step |")
    print("|---------------|-------------|----------------|")
    for v in losses:
        print(f"| {v:<13} | {losses[v][0]:11.6f} | {losses[v][-1]:14.6f} |")
    spread = max(abs(losses[v][i] - losses["ours"][i]) for v in losses for i in (0, -1))
    print(f"max |loss - ours| (step 1 and last step): {spread:.2e}")


if __name__ == "__main__":
    main()
