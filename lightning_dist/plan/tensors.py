"""The shapes the planner counts communication in: a collective, the dtypes of a precision, a parameter as a rank
holds it before FSDP2, and the parameters of an MoE block (:mod:`lightning_dist.models.moe`), which FSDP2 gathers
as its own units where expert parallelism splits the experts (:mod:`lightning_dist.parallel.expert`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.pipeline import stage_ids
from lightning_dist.plan.layout import Layout, stage_split


@dataclass(frozen=True)
class Collective:
    """``calls`` calls of one op on one axis, each moving ``size`` bytes; ``what`` says who issues them."""

    axis: str
    op: str
    size: int
    calls: int
    what: str

    @property
    def bytes(self) -> int:
        return self.size * self.calls


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: gathered parameters / activations, gradient reduction, and the master weights."""

    compute: int = 2
    reduce: int = 4
    master: int = 4

    @classmethod
    def of(cls, precision: str) -> Dtypes:
        """From Lightning's precision string: ``bf16-mixed`` (fp32 master weights, bf16 compute, fp32 reduction)."""
        if precision in ("32-true", "32", "64-true"):
            size = 8 if precision == "64-true" else 4
            return cls(size, size, size)
        if precision.endswith("-true"):
            return cls(2, 2, 2)
        return cls(2, 4, 4)


@dataclass(frozen=True)
class Tensor:
    """A parameter as one rank holds it before FSDP2: tp-local shape, and whether SP leaves its gradient partial."""

    dim0: int
    rest: int
    partial_grad: bool = False

    def padded(self, dp_shard: int) -> int:
        return math.ceil(self.dim0 / dp_shard) * dp_shard * self.rest


def moe_block_tensors(cfg: GPTConfig, tp: int, sequence_parallel: bool = True) -> list[Tensor]:
    """One MoE block's parameters outside its routed experts, tp-local: attention and norms as a dense block's, the
    router gate ``(E, C)`` whole on every tp rank, the shared experts split as the MLP."""
    h, hd, f = cfg.d_model, cfg.head_dim, cfg.moe.shared_experts * cfg.expert_hidden
    sp = tp > 1 and sequence_parallel
    attention = [
        Tensor(h, 1, sp),
        Tensor(cfg.n_heads * hd // tp, h),
        Tensor(cfg.kv_heads * hd // tp, h),
        Tensor(cfg.kv_heads * hd // tp, h),
        Tensor(h, cfg.n_heads * hd // tp),
        Tensor(h, 1, sp),
    ]
    shared = [Tensor(f // tp, h), Tensor(f // tp, h), Tensor(h, f // tp)] if f else []
    return [*attention, Tensor(cfg.moe.num_experts, h), *shared]


def expert_tensors(cfg: GPTConfig, ep: int) -> list[Tensor]:
    """One MoE block's routed experts on a rank: gate, up ``(E / ep, F, C)`` and down ``(E / ep, C, F)``, whole on
    every tp rank."""
    return [Tensor(cfg.moe.num_experts // ep, cfg.expert_hidden * cfg.d_model)] * 3


def moe_blocks_of_stage(cfg: GPTConfig, layout: Layout, stage: int) -> int:
    """MoE blocks pipeline rank ``stage`` holds (the first ``moe.dense_layers`` blocks of the model are dense)."""
    total = layout.pp * layout.options.pipeline.stages_per_rank
    if total == 1:
        return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    split = stage_split(cfg, total)
    mine = stage_ids(stage, layout.pp, layout.options.pipeline.stages_per_rank, layout.schedule)
    return sum(cfg.is_moe_layer(i) for sid in mine for i in split[sid])
