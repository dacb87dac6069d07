"""The planner's :class:`Layout` (one way to run a job) and how a GPT's blocks split into pipeline stages.

A layout is built on the objects the strategy runs: its degrees are a
:class:`~lightning_dist.parallel_dims.ParallelDims` and how its axes work (pipeline schedule and microbatches,
activation checkpointing, sequence and loss parallelism) a :class:`~lightning_dist.parallel.options.Parallelism`,
each validated when built, so a layout the strategy would refuse cannot be planned. Next to them is only what the
planner alone has: the micro batch, Lightning's gradient accumulation (without a pipeline), and two ways of running
that the mesh strategy does not (TP overlapped with the matmuls, Lightning's DDP).

The stage split is here because the cost (:mod:`lightning_dist.plan.cost`) and the collectives
(:mod:`lightning_dist.plan.collectives`) both need to know which blocks a pipeline rank holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline import balanced_split
from lightning_dist.parallel_dims import AXES, DP_AXES, ParallelDims
from lightning_dist.plan.memory import block_params
from lightning_dist.plan.moe_memory import expert_params, moe_dense_params

#: The degrees in the plan's JSON: the data-parallel axes, then the others innermost first (dp_replicate, dp_shard,
#: tp, cp, pp).
JSON_DEGREES: tuple[str, ...] = (*DP_AXES, *(axis for axis in reversed(AXES) if axis not in DP_AXES))
#: The DiLoCo options that change its cost (``parallelism.diloco.<name>``), in the plan's JSON as ``diloco_<name>``.
DILOCO_FIELDS: tuple[str, ...] = ("every", "fragments", "delay", "compression")


@dataclass(frozen=True)
class Layout:
    """One way to run the job: its degrees, its options, and what only the planner varies.

    Args:
        dims: The degrees (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``) over ``dims.world_size``
            ranks.
        options: Pipeline schedule, stages per rank and microbatches (``pp > 1``), activation checkpointing,
            sequence and loss parallelism.
        micro_batch: Samples per forward (under pp, one pipeline microbatch).
        accumulate: Micro batches Lightning accumulates per optimizer step (``trainer.accumulate_grad_batches``);
            1 under pp, whose micro batches are the pipeline's (``options.pipeline.microbatches``).
        tp_overlap: TP collectives overlapped with the matmuls (Megatron's ``--tp-comm-overlap``, async TP).
        ddp: Lightning's ``DDPStrategy`` (``parallelism=ddp``) rather than the mesh strategy's replicas.

    DiLoCo (``options.sync="diloco"``, its ``diloco`` section) is an option like the others: the replicas on
    ``dp_replicate`` train apart and meet every ``diloco.every`` steps (:mod:`lightning_dist.plan.collectives`).

    Raises:
        ValueError: The layout cannot run (the degrees, the options, or the two together; one line naming the fix).
    """

    dims: ParallelDims
    options: Parallelism
    micro_batch: int
    accumulate: int = 1
    tp_overlap: bool = False
    ddp: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch={self.micro_batch} must be >= 1.")
        if self.accumulate < 1:
            raise ValueError(f"accumulate={self.accumulate} must be >= 1.")
        if self.dims.pp_enabled and self.accumulate != 1:
            raise ValueError(
                f"accumulate={self.accumulate} with pp={self.pp}: a pipeline accumulates over its microbatches; set "
                "options.pipeline.microbatches instead."
            )
        if self.ddp and self.dims.dp_replicate != self.dims.world_size:
            raise ValueError(f"ddp=True replicates the whole model but the layout is {self.dims.describe()}.")
        if (
            self.ddp and self.options.diloco_enabled
        ):  # Lightning's reducer averages every step (strategies/data_parallel.py)
            raise ValueError("ddp=True averages gradients every step; sync=diloco runs on the mesh strategy only.")
        self.options.check(self.dims)

    @classmethod
    def of(
        cls, micro_batch: int, microbatches: int, *, tp_overlap: bool = False, ddp: bool = False, **fields: Any
    ) -> Layout:
        """A layout from the planner's numbers: ``microbatches`` are the micro batches per optimizer step (the
        pipeline's under pp, else the ones Lightning accumulates); ``fields`` are the degrees (``dp_replicate``,
        ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``; 1 when not given) and :class:`Parallelism` options (a
        section's field by its own name: :meth:`Parallelism.with_fields`)."""
        degrees = {axis: fields.pop(axis, 1) for axis in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        ep = degrees.pop("ep")
        dims = ParallelDims(math.prod(degrees.values()), **degrees, ep=ep)
        options = Parallelism().with_fields(microbatches=microbatches if dims.pp > 1 else None, **fields)
        accumulate = 1 if dims.pp > 1 else microbatches
        return cls(dims, options, micro_batch, accumulate, tp_overlap=tp_overlap, ddp=ddp)

    # ------------------------------------------------------------------------- read-only views of dims and options
    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.dims.dp_shard

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 shards a parameter over: ``dp_shard x cp`` (cp ranks hold the same parameters)."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def schedule(self) -> str:
        return self.options.pipeline.schedule

    @property
    def stages_per_rank(self) -> int:
        return self.options.pipeline.stages_per_rank

    @property
    def microbatches(self) -> int:
        """Micro batches per optimizer step: the pipeline's (pp > 1), else the ones Lightning accumulates."""
        return self.options.pipeline.num_microbatches(self.dims.pp) if self.dims.pp_enabled else self.accumulate

    @property
    def ac(self) -> str:
        """Activation checkpointing: ``none``, ``selective`` or ``full``."""
        return self.options.activation_checkpointing.mode

    @property
    def ac_selective(self) -> str:
        """For ``ac="selective"``: ``op`` (keep matmul outputs), ``op_half`` (every other) or ``<n>``."""
        return self.options.activation_checkpointing.selective

    @property
    def diloco(self) -> bool:
        """Whether the replicas on ``dp_replicate`` train apart and meet in DiLoCo's outer steps."""
        return self.options.diloco_enabled

    @property
    def sync(self) -> str:
        """How the replicas agree: ``every_step`` or ``diloco``."""
        return self.options.sync

    @property
    def sequence_parallel(self) -> bool:
        return self.options.tensor.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.options.tensor.loss_parallel

    # ------------------------------------------------------------------------------------------------- output
    def to_json(self) -> dict[str, Any]:
        """The plan's JSON object for this layout (plain values, in the planner's names)."""
        degrees = self.dims.degrees
        return {
            **{axis: degrees[axis] for axis in JSON_DEGREES},
            "ep": self.dims.ep,
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "stages_per_rank": self.stages_per_rank,
            "ac": self.ac,
            "ac_selective": self.ac_selective,
            "tp_overlap": self.tp_overlap,
            "ddp": self.ddp,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
            "sync": self.sync,
            "float8": self.options.float8,
            "loss_chunks": self.options.loss_chunks,
            **({f"diloco_{key}": getattr(self.options.diloco, key) for key in DILOCO_FIELDS} if self.diloco else {}),
        }

    def describe(self) -> str:
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        degrees = f"pp{self.pp} tp{self.tp}{cp} dp_replicate{self.dp_replicate} dp_shard{self.dp_shard}{ep}"
        pipe = f" {self.schedule} v{self.stages_per_rank}" if self.pp > 1 else ""
        extra = (f" float8={self.options.float8}" if self.options.float8 != "off" else "") + (
            f" loss_chunks={self.options.loss_chunks}" if self.options.loss_chunks else ""
        )
        return f"{degrees}{pipe} m{self.microbatches} mb{self.micro_batch} ac={self.ac}{self.describe_sync()}{extra}"

    def describe_sync(self) -> str:
        """`` diloco H=50 F=1 tau=0 int8`` under DiLoCo, else ``""``."""
        if not self.diloco:
            return ""
        o = self.options.diloco
        return f" diloco H={o.every} F={o.fragments} tau={o.delay} {o.compression}"


# ------------------------------------------------------------------------------------------------ stage split
def stage_blocks(cfg: GPTConfig, num_stages: int) -> list[int]:
    """Blocks of each of ``num_stages`` pipeline stages, as the strategy splits them."""
    return [len(group) for group in stage_split(cfg, num_stages)] if num_stages > 1 else [cfg.n_layers]


def stage_split(cfg: GPTConfig, num_stages: int) -> list[list[int]]:
    """Block indices of each of ``num_stages`` pipeline stages: balanced by parameter count with the embedding on the
    first and the final norm and head on the last (:func:`lightning_dist.parallel.pipeline.balanced_split`)."""
    return _balanced_split(tuple(layer_params(cfg, 2)), num_stages)


def layer_params(cfg: GPTConfig, pp: int) -> list[float]:
    """Parameters per block (an MoE block's routed experts included), the embedding counted on the first and the
    final norm and head on the last."""
    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings and pp == 1 else cfg.vocab_size * cfg.d_model
    moe = float(moe_dense_params(cfg) + expert_params(cfg))  # an MoE block, its experts included
    costs = [moe if cfg.is_moe_layer(i) else float(block_params(cfg)) for i in range(cfg.n_layers)]
    costs[0] += embedding
    costs[-1] += head + cfg.d_model
    return costs


@functools.lru_cache(maxsize=256)
def _balanced_split(costs: tuple[float, ...], num_stages: int) -> list[list[int]]:
    """The strategy's split, cached: a search asks for the same model's split thousands of times."""
    return balanced_split(list(costs), num_stages)
