"""The planner's estimate for the layout a run used, next to what the run measured (for the run report)."""

from __future__ import annotations

import statistics
from typing import Any

from lightning_dist.config import TrainConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.plan.cost import Layout, estimate
from lightning_dist.plan.memory import GIB


def layout_of(cfg: TrainConfig, dims: Any) -> Layout:
    """The planner's :class:`Layout` for ``cfg``'s run under ``dims``."""
    par = cfg.parallelism
    per_rank = cfg.data.global_batch_size // dims.dp_size
    micro = cfg.data.micro_batch_size or (
        per_rank // par.microbatches if dims.pp > 1 and par.microbatches else per_rank
    )
    steps = per_rank // micro if micro else 1
    schedule = par.schedule if dims.pp > 1 else "1F1B"
    degrees = (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp)
    return Layout(*degrees, micro, steps, schedule, par.stages_per_rank, par.activation_checkpointing)


def predicted_and_measured(cfg: TrainConfig, dims: Any, result: dict[str, Any]) -> dict[str, list[Any]] | None:
    """``{quantity: [predicted, measured]}`` for the built-in GPT; None for other models (nothing to estimate)."""
    if not isinstance(cfg.model, GPTConfig) or not hasattr(cfg.data, "seq_len"):
        return None
    try:
        found = estimate(cfg.model, layout_of(cfg, dims), cfg.hardware, cfg.data.seq_len, cfg.data.global_batch_size)
    except ValueError:
        return None
    history = result.get("history", [])

    def median(key: str) -> float | None:
        values = [r[key] for r in history if key in r]
        return round(statistics.median(values), 3) if values else None

    memory = [r.get("memory/peak_allocated_gib", r.get("memory/rss_gib")) for r in history]
    measured_memory = max((m for m in memory if m is not None), default=None)
    return {
        "model states GiB per rank (params, grads, AdamW)": [
            round((found.memory.params + found.memory.grads + found.memory.optimizer) / GIB, 3), None],
        "peak memory GiB per rank": [round(found.memory.total / GIB, 3), measured_memory],
        "tokens/s per device": [round(found.tokens_per_sec_per_device, 1), median("perf/tokens_per_sec_per_device")],
        "pipeline bubble fraction": [round(found.bubble_fraction, 3), median("pipeline/bubble_fraction")],
        "communication bytes per step": [{a: int(c["bytes"]) for a, c in found.comm.items()}, None],
    }  # fmt: skip
