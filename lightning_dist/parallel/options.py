"""ParallelOptions: everything a layout needs besides its degrees, in one frozen object validated once.

The degrees (how many ranks on each axis) are :class:`~lightning_dist.parallel_dims.ParallelDims`; how each axis
works (the TP plan and sequence / loss parallelism, the pipeline schedule and its microbatches, activation
checkpointing, compile, offload, the non-finite guard, checkpoint saving, process groups) is this object. The app
builds it once from the config (:func:`lightning_dist.config.validate.validate`) and hands it whole to the strategy,
which passes it on to :func:`~lightning_dist.parallel.compose.parallelize`, the pipeline builder and the planner.

Rules that need the degrees too are :meth:`ParallelOptions.check`, called by the pre-launch validation (with the
config's field names) and by the strategy once it knows its world size: each rule is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_dist.parallel import schedules
from lightning_dist.parallel.ac_modes import check_mode as check_ac_mode

if TYPE_CHECKING:
    from lightning_dist.parallel_dims import ParallelDims

#: What a step whose gradient norm is NaN / Inf does: end the run, or drop the update and train on.
NONFINITE_ACTIONS = ("stop", "skip")
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelOptions:
    """How a layout's axes work (frozen; validated on construction).

    Args:
        sequence_parallel: TP: shard norms and residuals along the sequence.
        loss_parallel: TP: cross-entropy on vocab-sharded logits (no all-gather of logits).
        plan: TP: module-name pattern -> ``ParallelStyle`` or ``"colwise"`` / ``"rowwise"`` / ``"sequence"``;
            ``None`` = the module's ``tensor_parallel_plan()``.
        schedule: PP: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
            ``ZBVZeroBubble`` or ``DualPipeV`` (any case; stored canonical).
        microbatches: PP: microbatches per step, dividing the per-rank batch; ``None`` = ``pp x stages_per_rank``.
        stages_per_rank: PP: virtual stages per rank (2+ for the interleaved / looped / V schedules).
        split_points: PP: block names that start a new stage (``["layers.2"]``); ``None`` = balanced by parameters.
        activation_checkpointing: ``none``, ``full`` or ``selective``, applied to the blocks ``pipeline_spec()``
            names, in whole models and pipeline stages alike.
        ac_selective: For ``selective``: ``op``, ``op_half`` or ``"<n>"`` (every n-th block fully).
        compile: ``torch.compile`` each block after TP and checkpointing, before FSDP2.
        cpu_offload: FSDP2 keeps parameter shards, gradients and optimizer state in host memory.
        on_nonfinite: A step whose gradient norm is NaN / Inf: ``stop`` the run, or ``skip`` the update.
        async_save: Checkpoints are copied to host memory and written in the background (DCP ``async_save``).
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout: a rank that stops answering ends the job after this long.

    The precision policy is not here: Lightning's ``Trainer(precision=...)`` is its one source, and the strategy
    derives FSDP2's compute dtype from it.

    Raises:
        ValueError: One line naming the field, its value and the fix.
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True
    plan: Mapping[str, Any] | None = None
    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    activation_checkpointing: str = "none"
    ac_selective: str = "op"
    compile: bool = False
    cpu_offload: bool = False
    on_nonfinite: str = "stop"
    async_save: bool = False
    process_group_backend: str | None = None
    timeout: timedelta = field(default=DEFAULT_TIMEOUT)

    def __post_init__(self) -> None:
        # Canonical forms, so equal options compare equal: a tuple of split points, the schedule's own spelling.
        if self.split_points is not None and not isinstance(self.split_points, tuple):
            object.__setattr__(self, "split_points", tuple(self.split_points) or None)
        object.__setattr__(self, "schedule", schedules.resolve_schedule(self.schedule, self.stages_per_rank))
        check_ac_mode(self.activation_checkpointing, self.ac_selective)
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} is unknown; use stop (end the run) or skip (drop such steps)."
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches} must be >= 1, or None (pp x stages_per_rank).")

    @classmethod
    def build(cls, options: ParallelOptions | None = None, **overrides: Any) -> ParallelOptions:
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name is one line listing the known."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} is not a layout option; the options are {', '.join(sorted(known))}."
            )
        if options is None:
            return cls(**overrides)
        return replace(options, **overrides) if overrides else options

    def num_microbatches(self, pp: int) -> int:
        """Microbatches per pipeline step: as set, else one per stage (``pp x stages_per_rank``)."""
        return self.microbatches if self.microbatches is not None else pp * self.stages_per_rank

    def check(self, dims: ParallelDims, prefix: str = "", per_rank_batch: int | None = None) -> None:
        """The rules that need the degrees as well; the pre-launch pass and the strategy both call this.

        Args:
            dims: The layout's degrees.
            prefix: Put before each option's name in messages (``"parallelism."`` for the config's fields).
            per_rank_batch: The batch each data-parallel rank reads, when known (microbatches must divide it).

        Raises:
            ValueError: One line naming the values and the fix.
        """
        p = prefix
        if self.compile and dims.tp_enabled:
            raise ValueError(compile_with_tp_error(dims.tp, p))
        if self.cpu_offload and not dims.dp_enabled:
            raise ValueError(
                f"{p}cpu_offload=true needs FSDP2 shards to offload but the layout is {dims.describe()}; set "
                f"{p}dp_shard > 1 (e.g. parallelism=fsdp) or {p}cpu_offload=false."
            )
        if dims.pp_enabled:
            self.check_microbatches(dims.pp, prefix, per_rank_batch)

    def check_microbatches(self, pp: int, prefix: str = "", per_rank_batch: int | None = None) -> None:
        """The pipeline's microbatches against its schedule (torch's own requirements) and the per-rank batch."""
        try:
            schedules.check_microbatches(
                self.schedule, self.num_microbatches(pp), pp, self.stages_per_rank, per_rank_batch
            )
        except ValueError as err:
            raise ValueError(f"{prefix}{err}") from None  # the same message, named as the caller's field


def compile_with_tp_error(tp: int, prefix: str = "") -> str:
    """Why compile and tensor parallelism are refused together (on torch 2.13; seen on CPU, every TP plan we have)."""
    return (
        f"{prefix}compile=true with {prefix}tp={tp}: torch's compiled backward of tensor-parallel blocks fails (a "
        "DTensor gradient arrives as a plain Tensor in redistribute's backward: AttributeError '_local_tensor'; "
        f"cf. pytorch/pytorch#173123); use compile with tp=1 (fsdp, pp) or {prefix}compile=false."
    )
