"""Wall time per token of synchronous data parallelism vs DiLoCo over a shaped 1 Gb/s link, on CPU (gloo).

Run by hand: ``.venv/bin/python benchmarks/diloco_link.py [--gbps 0.125] [--latency-ms 1] [--every 20]``.

Two ranks, each one replica (``dp_shard=1``): every collective between them crosses the "link" between two sites.
:class:`ShapedLink` wraps torch.distributed's collectives in each rank (under the telemetry's tracker, where a slow
network would show) and makes each one last ``latency + bus bytes / bandwidth`` (bus bytes: nccl-tests' size x the
op's bus factor, what a ring moves per rank). A blocking call sleeps the rest of that time after the real call; an
``async_op`` one returns a work whose ``wait()`` does (the preemption flag's all-reduce, read a step later, keeps its
overlap). Shaped: ``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` / ``all_gather_single`` and
``reduce_scatter_tensor`` / ``reduce_scatter_single`` on groups of more than one rank: the HSDP gradient all-reduce
of the sync run (FSDP2 issues it blocking, one per unit), DiLoCo's outer exchange, and the loop's scalars.

Runs (the app's GPT at ``--d-model`` x ``--layers``, global batch ``--batch`` x ``--seq`` tokens; FLOPs small next
to the parameters, so that, as for a large model on GPUs, a 1 Gb/s link dominates the synchronous step):
``sync`` (``parallelism=fsdp dp_replicate=2 dp_shard=1``) and ``diloco`` (H = ``--every``, fp32), each unshaped and
shaped. Timed: the steps after ``--warmup`` (a multiple of H, so the window holds whole outer cycles).

Predictions beside the measurement:

- planner: ``lightning_dist.plan.cost.estimate`` for the run's layout on a "hardware" describing this machine and link
  (``gpus_per_node=1``, ``inter_node_gbps`` = the link, ``compute_efficiency=1``, ``peak_tflops`` calibrated so the
  planner's compute term equals the unshaped DiLoCo step); it assumes the replica all-reduce overlaps 90% of the
  backward (true of DDP's buckets on GPUs, not of FSDP2's blocking all-reduce on CPU) and no latency.
- analytic: the unshaped step of the same run + the shaped delay per step: sum over its collectives of latency +
  bus bytes / bandwidth (from the telemetry's counts), DiLoCo's exchange once per H steps.

Results (2-core CPU VM shared with other jobs, torch 2.13.0+cpu, gloo; GPT d_model 512 x 4 layers, 11.9M
parameters, global batch 4 x 64 tokens, 80 steps, timed steps 21-80 = 3 outer cycles of H=20; 157 s in all)::

    .venv/bin/python benchmarks/diloco_link.py   # --gbps 0.125 --latency-ms 1 --every 20

    | run    | unshaped us/token | shaped us/token | analytic | planner | shaped / unshaped |
    |--------|-------------------|-----------------|----------|---------|-------------------|
    | sync   | 1664              | 2963            | 3172     | 1999    | 1.78x             |
    | diloco | 1288              | 1358            | 1388     | 1366    | 1.05x             |

    shaped: sync / DiLoCo wall time per token = 2.18x (calibrated peak 27.9 GFLOP/s per rank)

Reading: over the 1 Gb/s link the synchronous run spends 0.33 s more per step (47.5 MB of fp32 gradients per step,
390 ms of ``comm/dp/ms``); DiLoCo pays the same exchange once per 20 steps (its telemetry: ``diloco/outer_ms`` 529,
``diloco/outer_fraction`` 0.074, ``diloco/bytes_per_outer_step`` 47,466,496 = 4 x 11,866,624 parameters) and runs
2.18x faster per token. The analytic column (unshaped step + shaped delay) is within 7% (sync: it adds the whole
link time on top of an unshaped step that already paid gloo's own ~0.1 s; the shaping only sleeps the rest). The
planner is within 1% for DiLoCo (its compute term is calibrated on that run, so only its outer-step term is tested)
and 33% low for sync: it hides the replica all-reduce under 90% of the backward, which FSDP2's blocking all-reduce
on CPU does not do. Unshaped, sync is also slower (1664 vs 1288): gloo's own all-reduce of 47.5 MB per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

CONF_DIR = Path(__file__).resolve().parents[1] / "lightning_dist" / "conf"
#: torch.distributed names shaped -> (op for the bus factor, position of the size tensor, of the group).
SHAPED = {
    "all_reduce": ("all_reduce", 0, 2),
    "broadcast": ("broadcast", 0, 2),
    "all_gather_single": ("all_gather", 0, 2),  # output: the gathered size
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "reduce_scatter_single": ("reduce_scatter", 1, 3),  # input: the full size
    "reduce_scatter_tensor": ("reduce_scatter", 1, 3),
}


class _DelayedWork:
    """An async collective's work whose ``wait()`` returns no earlier than ``deadline`` (perf_counter seconds)."""

    def __init__(self, work: Any, deadline: float) -> None:
        self._work, self._deadline = work, deadline

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        time.sleep(max(0.0, self._deadline - time.perf_counter()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class ShapedLink:
    """Every collective on a group of more than one rank lasts ``latency_s + bus bytes / (gbps x 1e9)``.

    Attributes:
        seconds: Time added so far (sleeps), for the record.
    """

    def __init__(self, gbps: float, latency_s: float) -> None:
        self.gbps, self.latency_s, self.seconds = gbps, latency_s, 0.0
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> ShapedLink:
        import torch.distributed as dist

        from lightning_dist.telemetry.comm import BUS_FACTORS

        c10d = dist.distributed_c10d
        for name, (op, tensor_pos, group_pos) in SHAPED.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue

            def shaped(*args: Any, _fn: Any = original, _op: str = op, _t: int = tensor_pos, _g: int = group_pos,
                       **kwargs: Any) -> Any:  # fmt: skip
                group = kwargs.get("group", args[_g] if len(args) > _g else None)
                size = dist.get_world_size(group)
                if size < 2:
                    return _fn(*args, **kwargs)
                tensor = args[_t] if len(args) > _t else next(iter(kwargs.values()))
                cost = self.latency_s + tensor.numel() * tensor.element_size() * BUS_FACTORS[_op](size) / (
                    self.gbps * 1e9
                )
                began = time.perf_counter()
                out = _fn(*args, **kwargs)
                self.seconds += cost
                if kwargs.get("async_op"):
                    return _DelayedWork(out, began + cost)
                time.sleep(max(0.0, began + cost - time.perf_counter()))
                return out

            for holder in (dist, c10d):
                if getattr(holder, name, None) is original:
                    setattr(holder, name, shaped)
                    self._undo.append((holder, name, original))
        return self

    def uninstall(self) -> None:
        for holder, name, original in reversed(self._undo):
            setattr(holder, name, original)
        self._undo.clear()


class StepClock(pl.Callback):
    """Wall time from the end of optimizer step ``warmup`` to the end of the run."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.began, self.ended, self.steps = warmup, None, None, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if trainer.global_step == self.warmup:
            self.began = now
        if self.began is not None:
            self.ended, self.steps = now, trainer.global_step - self.warmup


def compose(overrides: list[str], output_dir: str) -> Any:
    """The config ``lightning-dist-train <overrides>`` would run (as ``tests/helpers.py`` composes it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.config.schema import register_configs, to_train_config

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(hydra_compose(config_name="train", overrides=overrides))
    cfg.output_dir = output_dir
    return cfg


def _rank(runs: dict[str, Any], gbps: float, latency_s: float, warmup: int) -> dict[str, Any]:
    """In each rank: every run one after the other, shaped or not; the timed window and the telemetry's last log."""
    import torch
    import torch.distributed as dist

    from lightning_dist.run.fit import fit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {}
    for name, (cfg, shaped) in runs.items():
        link = ShapedLink(gbps, latency_s).install() if shaped else None
        clock = StepClock(warmup)
        try:
            result = fit(cfg, callbacks=[clock])
        finally:
            if link is not None:
                link.uninstall()
        last = next((r for r in reversed(result.history) if "perf/step_ms" in r), {})
        out[name] = {
            "seconds": clock.ended - clock.began,
            "steps": clock.steps,
            "added_s": link and link.seconds,
            "telemetry": {k: v for k, v in last.items() if k.startswith(("comm/", "diloco/", "perf/"))},
        }
    return out


def planner_seconds(cfg: Any, gbps: float, peak_tflops: float) -> float:
    """The planner's step seconds for ``cfg``'s 2-replica layout on this machine's calibrated "hardware"."""
    from lightning_dist.config.validate import validate
    from lightning_dist.plan.cost import estimate
    from lightning_dist.plan.estimate_run import layout_of

    valid = validate(cfg)
    hw = type(valid.cfg.hardware)(name="this CPU over a shaped link", peak_tflops=peak_tflops, gpus_per_node=1,
                                  inter_node_gbps=gbps, intra_node_gbps=gbps, compute_efficiency=1.0,
                                  memory_tbps=3.35)  # fmt: skip
    found = estimate(valid.cfg.model, layout_of(valid.cfg, valid.dims), hw, valid.cfg.data.seq_len,
                     valid.cfg.data.global_batch_size, valid.cfg.cluster.precision)  # fmt: skip
    return found.step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gbps", type=float, default=0.125, help="link bandwidth, GB/s (0.125 = 1 Gb/s)")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--every", type=int, default=20, help="DiLoCo's H")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/diloco_link"))
    args = parser.parse_args()
    from lightning_dist.plan.cost import flops_per_token_of
    from lightning_dist.run.launch import launch

    common = [
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=8", "model.n_kv_heads=4",
        f"data.global_batch_size={args.batch}", f"data.seq_len={args.seq}", f"model.max_seq_len={args.seq}",
        f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
        "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false", "logger=none",
        "telemetry.report=false", "cluster.devices=2", f"data.num_train_samples={args.batch * (args.steps + 1)}",
    ]  # fmt: skip
    layouts = {
        "sync": ["parallelism=fsdp", "parallelism.dp_replicate=2", "parallelism.dp_shard=1"],
        "diloco": ["parallelism=diloco", f"parallelism.diloco.every={args.every}"],
    }
    cfgs = {name: compose([*common, *extra], str(args.out / name)) for name, extra in layouts.items()}
    runs = {f"{name} {'shaped' if shaped else 'unshaped'}": (cfgs[name], shaped)
            for name in layouts for shaped in (False, True)}  # fmt: skip
    began = time.perf_counter()
    ranks = launch(_rank, 2, runs, args.gbps, args.latency_ms / 1e3, args.warmup)
    print(f"all runs: {time.perf_counter() - began:.0f} s")
    tokens = args.batch * args.seq  # per step, global
    measured = {}
    for name in runs:
        seconds = max(rank[name]["seconds"] for rank in ranks)  # the slower rank sets the pace
        measured[name] = seconds / ranks[0][name]["steps"]
    cfg = cfgs["diloco"]
    flops = flops_per_token_of(cfg.model, args.seq) * tokens / 2  # per rank per step
    peak = flops / measured["diloco unshaped"] / 1e12
    rows = []
    for name in layouts:
        step, base = measured[f"{name} shaped"], measured[f"{name} unshaped"]
        added = max(rank[f"{name} shaped"]["added_s"] for rank in ranks) / args.steps  # whole run's delay per step
        rows.append({"run": name, "unshaped_step_s": base, "shaped_step_s": step,
                     "us_per_token": step / tokens * 1e6, "unshaped_us_per_token": base / tokens * 1e6,
                     "analytic_us_per_token": (base + added) / tokens * 1e6,
                     "planner_us_per_token": planner_seconds(cfgs[name], args.gbps, peak) / tokens * 1e6,
                     "telemetry": ranks[0][f"{name} shaped"]["telemetry"]})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                                       "calibrated_peak_tflops": peak}, indent=1) + "\n")  # fmt: skip
    head = "| run | unshaped us/token | shaped us/token | analytic | planner | shaped / unshaped |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['unshaped_us_per_token']:.0f} | {r['us_per_token']:.0f} | "
                     f"{r['analytic_us_per_token']:.0f} | {r['planner_us_per_token']:.0f} | "
                     f"{r['shaped_step_s'] / r['unshaped_step_s']:.2f}x |")  # fmt: skip
    sync, diloco = rows
    lines.append(f"\nshaped: sync / DiLoCo wall time per token = {sync['us_per_token'] / diloco['us_per_token']:.2f}x "
                 f"(link {args.gbps} GB/s, latency {args.latency_ms} ms, H={args.every}, calibrated peak "
                 f"{peak * 1e3:.1f} GFLOP/s per rank)")  # fmt: skip
    markdown = "\n".join(lines)
    (args.out / "results.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
