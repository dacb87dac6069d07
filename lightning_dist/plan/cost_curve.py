"""The cost curve: for each GPU count, the best synchronous layout and the best DiLoCo layout, the time they take to
train a token budget and what that costs (``lightning-dist-plan plan.tokens=... plan.price_per_gpu_hour=...``).

Time is the budget over the whole job's tokens/s (the layout's tokens/s per device x GPUs); cost is that time in
hours x the price of one GPU-hour x GPUs. Both columns come from the same search (:func:`lightning_dist.plan.search.
rank`): "sync" is the fastest layout that fits whose replicas average gradients every step, "DiLoCo" the fastest that
fits with ``sync=diloco`` at the run's H, F and tau (``parallelism.diloco``), any of ``plan.diloco_compressions``.
DiLoCo is only as good as its loss at the same tokens: this curve prices its throughput, not its quality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dist.config.schema import HardwareConfig, PlanConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.options import DiLoCoOptions
from lightning_dist.plan.cost import Estimate
from lightning_dist.plan.search import rank

#: GPU counts when ``plan.gpus`` is empty: one node, then doubling up to this many.
MAX_GPUS = 1024
#: The DiLoCo options the planner reads from ``parallelism`` (H, F, tau; compression is searched).


@dataclass(frozen=True)
class Point:
    """One layout's throughput, and the time and cost of training ``tokens`` with it on ``gpus`` GPUs."""

    estimate: Estimate
    gpus: int
    tokens: float
    price_per_gpu_hour: float | None

    @property
    def tokens_per_sec(self) -> float:
        return self.estimate.tokens_per_sec_per_device * self.gpus

    @property
    def hours(self) -> float:
        return self.tokens / self.tokens_per_sec / 3600

    @property
    def cost(self) -> float | None:
        """USD: hours x price per GPU-hour x GPUs (None without a price)."""
        return None if self.price_per_gpu_hour is None else self.hours * self.price_per_gpu_hour * self.gpus

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.estimate.layout.to_json(),
            "tokens_per_sec": round(self.tokens_per_sec, 1),
            "hours": round(self.hours, 3),
            "cost_usd": None if self.cost is None else round(self.cost, 2),
            "mfu": round(self.estimate.mfu, 4),
            "memory_gib": self.estimate.to_json()["memory_gib"],
        }


@dataclass(frozen=True)
class Row:
    """One GPU count: the best synchronous and the best DiLoCo layout (None where none fits)."""

    gpus: int
    sync: Point | None
    diloco: Point | None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "sync": self.sync and self.sync.to_json(),
            "diloco": self.diloco and self.diloco.to_json(),
        }


def gpu_counts(plan: PlanConfig, gpus_per_node: int) -> list[int]:
    """``plan.gpus``, or one node doubling up to :data:`MAX_GPUS`."""
    counts = list(plan.gpus)
    if not counts:
        n = gpus_per_node
        while n <= MAX_GPUS:
            counts.append(n)
            n *= 2
    if any(n < 1 for n in counts):
        raise ValueError(f"plan.gpus={counts} must be positive GPU counts.")
    return sorted(set(counts))


def cost_curve(
    model: GPTConfig,
    hw: HardwareConfig,
    seq_len: int,
    global_batch: int,
    plan: PlanConfig,
    tokens: float,
    price_per_gpu_hour: float | None,
    diloco: DiLoCoOptions | None = None,
) -> list[Row]:
    """For each of :func:`gpu_counts`, the best layout that fits, synchronous and DiLoCo, priced for ``tokens``.

    Raises:
        ValueError: A token budget or a price that is not positive.
    """
    if not tokens > 0:
        raise ValueError(f"plan.tokens={tokens} must be a positive token budget (e.g. 1e12).")
    if price_per_gpu_hour is not None and not price_per_gpu_hour > 0:
        raise ValueError(f"plan.price_per_gpu_hour={price_per_gpu_hour} must be > 0 (USD per GPU-hour).")
    rows = []
    for gpus in gpu_counts(plan, hw.gpus_per_node):
        fitting = [e for e in rank(model, hw, gpus, seq_len, global_batch, plan, diloco) if e.fits]
        best = {
            kind: next(
                (Point(e, gpus, tokens, price_per_gpu_hour) for e in fitting if e.layout.diloco == is_diloco), None
            )
            for kind, is_diloco in (("sync", False), ("diloco", True))
        }
        rows.append(Row(gpus, best["sync"], best["diloco"]))
    return rows


def short(point: Point | None) -> str:
    """A layout in a few characters: ``pp2 tp2 dp4x8 op_half``, plus ``H50 int8`` (and ``F4 tau2``) under DiLoCo."""
    if point is None:
        return "none fits"
    lay = point.estimate.layout
    parts = [f"pp{lay.pp}"] if lay.pp > 1 else []
    parts += [f"tp{lay.tp}"] if lay.tp > 1 else []
    parts.append(f"dp{lay.dp_replicate}x{lay.dp_shard}")
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    parts.append(lay.ac if lay.ac != "selective" else lay.ac_selective)
    if lay.diloco:
        o = lay.options.diloco
        parts.append(f"H{o.every}")
        if o.fragments > 1 or o.delay:
            parts.append(f"F{o.fragments} tau{o.delay}")
        parts.append(o.compression)
    return " ".join(parts)


def duration(hours: float) -> str:
    """``5.2 h`` below two days, else ``12.3 d``."""
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} d"
