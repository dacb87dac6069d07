"""The planner's estimate for the layout a run used, next to what the run measured (for the run report)."""

from __future__ import annotations

import statistics
from typing import Any

from lightning_dist.config.schema import TrainConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel_dims import REPORTED_AXES, ParallelDims
from lightning_dist.plan.collectives import outer_collectives, per_axis, step_collectives
from lightning_dist.plan.cost import estimate
from lightning_dist.plan.experts import expert_collectives
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.memory import GIB


def layout_of(cfg: TrainConfig, dims: ParallelDims) -> Layout:
    """The planner's :class:`Layout` for ``cfg``'s run under ``dims``: the run's own degrees and options, its batch
    split into micro batches as the strategy splits it."""
    options = cfg.parallelism
    per_rank = cfg.data.global_batch_size // dims.dp_size
    if cfg.data.micro_batch_size:
        micro = cfg.data.micro_batch_size
    elif dims.pp_enabled:  # the strategy's default: one microbatch per stage
        micro = per_rank // options.pipeline.num_microbatches(dims.pp)
    else:
        micro = per_rank // cfg.trainer.accumulate_grad_batches
    steps, ddp = per_rank // micro, cfg.parallelism.strategy == "ddp"
    if dims.pp_enabled:  # the pipeline's microbatches
        return Layout(dims, options.with_fields(microbatches=steps), micro, ddp=ddp)
    return Layout(dims, options, micro, accumulate=steps, ddp=ddp)  # batches Lightning accumulates


def predicted_and_measured(cfg: TrainConfig, dims: ParallelDims, result: dict[str, Any]) -> dict[str, list[Any]] | None:
    """``{quantity: [predicted, measured]}`` for the built-in GPT; None for other models (nothing to estimate)."""
    if not isinstance(cfg.model, GPTConfig) or not hasattr(cfg.data, "seq_len"):
        return None
    try:
        layout = layout_of(cfg, dims)
        found = estimate(
            cfg.model, layout, cfg.hardware, cfg.data.seq_len, cfg.data.global_batch_size, cfg.cluster.precision
        )
        rank0 = None  # not modelled: virtual stages on pp=1, whose local schedule gathers FSDP2 units per pass
        if not (dims.pp == 1 and cfg.parallelism.pipeline.stages_per_rank > 1):
            planned = step_collectives(
                cfg.model, layout, cfg.data.seq_len, cfg.cluster.precision, stage=0, ddp=layout.ddp
            )
            planned += expert_collectives(cfg.model, layout, cfg.data.seq_len, cfg.cluster.precision, stage=0)
            rank0 = per_axis(planned)
    except ValueError:
        return None
    history = result.get("history", [])

    def median(key: str) -> float | None:
        values = [r[key] for r in history if key in r]
        return round(statistics.median(values), 3) if values else None

    steady = history[1:] or history  # the first step also infers pipeline shapes

    def measured_comm(kind: str) -> dict[str, int] | None:
        found = {}
        for axis in (*REPORTED_AXES, "world"):
            values = [r[f"comm/{axis}/{kind}"] for r in steady if f"comm/{axis}/{kind}" in r]
            if values:
                found[axis] = int(statistics.median(values))
        return found or None

    states = [r["memory/params_gib"] + r["memory/optimizer_gib"] for r in history if "memory/params_gib" in r]
    memory = [r.get("memory/peak_allocated_gib", r.get("memory/rss_gib")) for r in history]
    measured_memory = max((m for m in memory if m is not None), default=None)
    outer = {}
    if layout.diloco:  # per outer cycle: a step's median misses it (the per-step average is comm_bytes / H)
        cycle = sum(c.bytes for c in outer_collectives(cfg.model, layout, stage=0))
        key = "DiLoCo bytes per outer cycle (H steps) on dp_replicate, rank 0"
        outer = {key: [cycle, measured_cycle(history, layout.options.diloco.fragments)]}
    return {
        **outer,
        "parameters + optimizer state GiB, largest rank": [
            round((found.memory.params + found.memory.optimizer) / GIB, 6),
            round(max(states), 6) if states else None,
        ],
        "peak memory GiB per rank": [round(found.memory.total / GIB, 3), measured_memory],
        "tokens/s per device": [round(found.tokens_per_sec_per_device, 1), median("perf/tokens_per_sec_per_device")],
        "pipeline bubble fraction": [round(found.bubble_fraction, 3), median("pipeline/bubble_fraction")],
        "communication bytes per step, rank 0": [
            rank0 and {a: c["bytes"] for a, c in rank0.items()},
            measured_comm("bytes"),
        ],
        "communication calls per step, rank 0": [
            rank0 and {a: c["calls"] for a, c in rank0.items()},
            measured_comm("calls"),
        ],
    }


def measured_cycle(history: list[dict[str, Any]], fragments: int) -> int | None:
    """The bytes of one DiLoCo cycle as the telemetry measured them: its last logged ``diloco/bytes_per_outer_step``
    (the mean exchange since the fit started) times the ``fragments`` exchanged per cycle; None before any exchange
    (or with one replica, which exchanges nothing)."""
    exchanged = [r for r in history if r.get("diloco/outer_steps")]
    return round(exchanged[-1]["diloco/bytes_per_outer_step"] * fragments) if exchanged else None
