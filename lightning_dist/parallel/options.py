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
#: How replicas on ``dp_replicate`` agree: gradients averaged every step, or DiLoCo's outer steps every H steps.
SYNCS = ("every_step", "diloco")
#: How DiLoCo's pseudo-gradients travel (see :mod:`lightning_dist.parallel.diloco`).
COMPRESSIONS = ("fp32", "bf16", "int8")
#: Synchronous DDP's gradient compression: torch's DDP communication hooks (Lightning's DDP only).
DDP_COMM_HOOKS = ("bf16", "fp16", "powersgd")
#: Context parallelism's attention across the cp group (``lightning_dist.parallel.context_attention``): ``auto`` is
#: torch's ring attention on CUDA (``torch``), else ``allgather``.
CP_ATTENTIONS = ("auto", "allgather", "torch")
#: How torch's ring attention passes keys and values around the cp group (torch's ``set_rotate_method``).
CP_ROTATES = ("allgather", "alltoall")
#: Tensor-parallel style names a plan may give (``parallel/tensor.py: STYLE_NAMES`` makes them torch styles; here
#: without torch, for the checks before launch).
TP_STYLE_NAMES = (
    "colwise",
    "rowwise",
    "sequence",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)
#: FSDP2's gradient reduce-scatter / all-reduce dtype.
REDUCE_DTYPES = ("fp32", "bf16")
#: float8 training of the blocks' linear layers (torchao; :mod:`lightning_dist.parallel.float8`): one scale per
#: tensor (its FSDP2 all-gather in float8 too), one per row, or none.
FLOAT8_RECIPES = ("off", "tensorwise", "rowwise")
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
        sync: How the ``dp_replicate`` replicas agree: ``every_step`` (gradients averaged each step: DDP / HSDP) or
            ``diloco`` (each replica trains alone; every ``diloco_every`` steps an outer step averages their progress:
            DiLoCo, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512). Needs ``dp_replicate > 1``.
        diloco_every: DiLoCo: H, inner optimizer steps per outer step (per fragment).
        diloco_outer_lr: DiLoCo: outer SGD learning rate.
        diloco_outer_momentum: DiLoCo: outer SGD momentum (0 = none).
        diloco_nesterov: DiLoCo: Nesterov momentum for the outer SGD (needs ``diloco_outer_momentum > 0``).
        diloco_fragments: Streaming DiLoCo: F, contiguous parameter fragments synchronized H/F steps apart (1 = plain).
        diloco_delay: Streaming DiLoCo: tau, inner steps a fragment's exchange overlaps before it is applied
            (0 = blocking); below ``diloco_every // diloco_fragments``.
        diloco_alpha: Streaming DiLoCo: mixing factor, new = (1 - alpha) x outer result + alpha x local parameters.
        diloco_compression: DiLoCo: pseudo-gradients sent as ``fp32``, ``bf16`` or ``int8`` (per-block absmax).
        ddp_comm_hook: Lightning's DDP: compress the gradient all-reduce with torch's hook, ``bf16`` / ``fp16``
            (cast, all-reduce, cast back) or ``powersgd`` (rank-1 PowerSGD with error feedback, after torch's 1000
            plain warm-up steps); ``None`` = full precision. Not exact: the sum is rounded.
        reduce_dtype: FSDP2 (mesh layouts): the dtype gradients are reduced in, ``fp32`` or ``bf16`` (half the
            bytes, rounded sums); ``None`` = fp32 under mixed precision, else the parameters' dtype.
        cp_attention: CP: the attention across the cp group: ``allgather`` (all-gather of keys and values; any
            device and backend, exact), ``torch`` (torch's ring attention: CUDA's flash / efficient / cuDNN SDPA kernels
            on DTensors) or ``auto`` (``torch`` on CUDA, else ``allgather``); see :func:`resolve_cp_attention`.
        cp_rotate: CP, torch's ring attention: keys and values reach the other cp ranks by one ``allgather`` or by
            ``alltoall`` (``cp - 1`` ring steps); ``allgather`` only with ``cp_attention=allgather``.
        float8: The blocks' linear layers train in float8 (torchao's ``Float8Linear``; the embeddings and the head
            stay as they are): ``tensorwise`` (one dynamic scale per tensor; under FSDP2 the weights are all-gathered
            in float8, under TP torchao's float8 styles), ``rowwise`` (one scale per row: closer to bf16, slower) or
            ``off``. Emulated off CUDA SM 8.9+ (the same numbers, no speed-up). Parameters, gradients, optimizer
            state and checkpoints keep their dtype: a float8 run resumes without it and back.
        loss_chunks: Compute the output head and the loss in this many pieces of the tokens, each recomputed in the
            backward, so the whole ``(B, T, V)`` logits are never held (the module's ``set_loss_chunks``); 0 = off.

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
    sync: str = "every_step"
    diloco_every: int = 50
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    diloco_nesterov: bool = True
    diloco_fragments: int = 1
    diloco_delay: int = 0
    diloco_alpha: float = 0.0
    diloco_compression: str = "fp32"
    ddp_comm_hook: str | None = None
    reduce_dtype: str | None = None
    cp_attention: str = "auto"
    cp_rotate: str = "allgather"
    float8: str = "off"
    loss_chunks: int = 0

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
        self._check_diloco()
        if self.ddp_comm_hook is not None and self.ddp_comm_hook not in DDP_COMM_HOOKS:
            raise ValueError(
                f"ddp_comm_hook={self.ddp_comm_hook!r} is unknown; use {', '.join(DDP_COMM_HOOKS)} or null (none)."
            )
        if self.cp_attention not in CP_ATTENTIONS:
            raise ValueError(f"cp_attention={self.cp_attention!r} is unknown; use {', '.join(CP_ATTENTIONS)}.")
        if self.cp_rotate not in CP_ROTATES:
            raise ValueError(f"cp_rotate={self.cp_rotate!r} is unknown; use {', '.join(CP_ROTATES)}.")
        if self.cp_attention == "allgather" and self.cp_rotate != "allgather":
            raise ValueError(
                f"cp_rotate={self.cp_rotate} is for torch's ring attention but cp_attention=allgather runs the "
                "all-gather one; set cp_attention=torch (or auto on CUDA), or cp_rotate=allgather."
            )
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"float8={self.float8!r} is unknown; use {', '.join(FLOAT8_RECIPES)}.")
        if self.loss_chunks < 0:
            raise ValueError(f"loss_chunks={self.loss_chunks} must be >= 0 (0 = the plain loss, whole logits).")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r} is unknown; use {', '.join(REDUCE_DTYPES)} or null (automatic)."
            )

    @property
    def diloco(self) -> bool:
        """Whether the ``dp_replicate`` replicas train apart and meet in DiLoCo's outer steps."""
        return self.sync == "diloco"

    def _check_diloco(self) -> None:
        if self.sync not in SYNCS:
            raise ValueError(f"sync={self.sync!r} is unknown; use every_step (DDP / HSDP) or diloco.")
        every, fragments, delay = self.diloco_every, self.diloco_fragments, self.diloco_delay
        if every < 1:
            raise ValueError(f"diloco_every={every} must be >= 1 (inner steps per outer step).")
        if not 1 <= fragments <= every:
            raise ValueError(
                f"diloco_fragments={fragments} must be in [1, diloco_every={every}] (fragments sync every/fragments "
                "steps apart); lower it or raise diloco_every."
            )
        if not 0 <= delay < every // fragments:
            raise ValueError(
                f"diloco_delay={delay} must be in [0, diloco_every // diloco_fragments = {every // fragments}) so a "
                "fragment's exchange lands before the next fragment's; lower it."
            )
        if not self.diloco_outer_lr > 0:
            raise ValueError(f"diloco_outer_lr={self.diloco_outer_lr} must be > 0 (0.7 in the DiLoCo paper).")
        if not 0 <= self.diloco_outer_momentum < 1:
            raise ValueError(f"diloco_outer_momentum={self.diloco_outer_momentum} must be in [0, 1) (0.9: the paper).")
        if self.diloco_nesterov and self.diloco_outer_momentum == 0:
            raise ValueError("diloco_nesterov=true needs diloco_outer_momentum > 0; set one or diloco_nesterov=false.")
        if not 0 <= self.diloco_alpha <= 1:
            raise ValueError(f"diloco_alpha={self.diloco_alpha} must be in [0, 1] (0: take the outer result whole).")
        if self.diloco_compression not in COMPRESSIONS:
            raise ValueError(
                f"diloco_compression={self.diloco_compression!r} is unknown; use {', '.join(COMPRESSIONS)}."
            )

    def for_mesh(self) -> ParallelOptions:
        """These options, checked for the mesh strategies: Lightning DDP's own options are refused, not ignored."""
        if self.ddp_comm_hook is not None:
            raise ValueError(
                f"ddp_comm_hook={self.ddp_comm_hook!r} is Lightning DDP's; FSDP2 (the mesh strategies) halves its "
                "gradient bytes with reduce_dtype='bf16' instead."
            )
        return self

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
        if self.compile and dims.cp_enabled:
            raise ValueError(
                f"{p}compile=true with {p}cp={dims.cp}: compiled blocks with the context-parallel attention are not "
                f"tested yet; set {p}compile=false or {p}cp=1."
            )
        if dims.ep_enabled and self.compile:
            raise ValueError(
                f"{p}compile=true with {p}ep={dims.ep}: the dropless all-to-all's split sizes are read back to the "
                f"host in every MoE block, which a whole-graph compile of the block cannot hold; set {p}compile=false "
                f"or {p}ep=1."
            )
        if dims.ep_enabled and self.diloco:
            raise ValueError(
                f"{p}sync=diloco with {p}ep={dims.ep}: DiLoCo's outer step over expert-parallel replicas is not "
                f"written yet; set {p}sync=every_step or {p}ep=1."
            )
        if self.cpu_offload and not dims.dp_cp_enabled:
            raise ValueError(
                f"{p}cpu_offload=true needs FSDP2 shards to offload but the layout is {dims.describe()}; set "
                f"{p}dp_shard > 1 (e.g. parallelism=fsdp) or {p}cpu_offload=false."
            )
        if dims.pp_enabled:
            self.check_microbatches(dims.pp, prefix, per_rank_batch)
        if self.diloco and dims.dp_replicate < 2:
            raise ValueError(
                f"{p}sync=diloco averages replicas on dp_replicate but the layout is {dims.describe()}; set "
                f"{p}dp_replicate >= 2 or {p}sync=every_step."
            )

    def check_microbatches(self, pp: int, prefix: str = "", per_rank_batch: int | None = None) -> None:
        """The pipeline's microbatches against its schedule (torch's own requirements) and the per-rank batch."""
        try:
            schedules.check_microbatches(
                self.schedule, self.num_microbatches(pp), pp, self.stages_per_rank, per_rank_batch
            )
        except ValueError as err:
            raise ValueError(f"{prefix}{err}") from None  # the same message, named as the caller's field


def resolve_cp_attention(attention: str, rotate: str, device_type: str, prefix: str = "") -> str:
    """The cp attention that runs on ``device_type`` (``cpu``, ``cuda``; ``gpu`` is ``cuda``): ``auto`` is ``torch``
    on CUDA, else ``allgather``.

    torch's own context parallelism (2.13: ``torch.distributed.tensor.experimental``) routes only CUDA's flash,
    efficient and cuDNN SDPA kernels to its ring: on CPU the DTensor SDPA has no sharding rule at all.

    Raises:
        ValueError: An unknown name, ``torch`` off CUDA, or ``rotate=alltoall`` where the all-gather attention runs
            (one line each).
    """
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"{prefix}cp_attention={attention!r} is unknown; use {', '.join(CP_ATTENTIONS)}.")
    if rotate not in CP_ROTATES:
        raise ValueError(f"{prefix}cp_rotate={rotate!r} is unknown; use {', '.join(CP_ROTATES)}.")
    cuda = device_type in ("cuda", "gpu")
    if attention == "torch" and not cuda:
        raise ValueError(
            f"{prefix}cp_attention=torch runs torch's ring attention, whose kernels are CUDA's (flash / efficient / "
            f"cuDNN SDPA; torch 2.13), but the ranks run on {device_type}; set {prefix}cp_attention=allgather or auto."
        )
    resolved = attention if attention != "auto" else "torch" if cuda else "allgather"
    if resolved == "allgather" and rotate != "allgather":
        raise ValueError(
            f"{prefix}cp_rotate={rotate} is for torch's ring attention, but {prefix}cp_attention={attention} runs the "
            f"all-gather attention on {device_type}; set {prefix}cp_rotate=allgather."
        )
    return resolved


def check_expert_parallel(num_experts: int, ep: int, prefix: str = "") -> None:
    """Raise a one-line ``ValueError`` when ``ep`` cannot split ``num_experts`` experts evenly."""
    if ep > 1 and num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"{prefix}ep={ep} does not divide the {num_experts} experts of each MoE block; use an ep in {divisors}."
        )


def compile_with_tp_error(tp: int, prefix: str = "") -> str:
    """Why compile and tensor parallelism are refused together (on torch 2.13; seen on CPU, every TP plan we have)."""
    return (
        f"{prefix}compile=true with {prefix}tp={tp}: torch's compiled backward of tensor-parallel blocks fails (a "
        "DTensor gradient arrives as a plain Tensor in redistribute's backward: AttributeError '_local_tensor'; "
        f"cf. pytorch/pytorch#173123); use compile with tp=1 (fsdp, pp) or {prefix}compile=false."
    )
