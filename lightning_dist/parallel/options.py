"""How a layout's axes work: one frozen option class per axis, which is both the ``parallelism`` config group's schema
and what the strategies, :func:`~lightning_dist.parallel.compose.parallelize` and the planner read at run time.

The degrees (how many ranks on each axis) are :class:`Parallelism`'s top-level fields and, resolved against the world
size, :class:`~lightning_dist.parallel_dims.ParallelDims`; how each axis works is a section: ``tensor``, ``pipeline``,
``context``, ``fsdp``, ``ddp``, ``diloco``, ``activation_checkpointing`` (and the single options ``sync``,
``compile``, ``float8``, ``loss_chunks``). The string under each field is its help text (``lightning-dist-train --help
parallelism``, docs/reference/config.md). Each class checks its own fields on construction, with messages that name
the field as the config does (``parallelism.pipeline.microbatches=0 ...``); rules that need the degrees too are
:meth:`Parallelism.check`, which the pre-launch pass and the strategy both call. Plain Python: the launcher builds and
checks these without importing torch.

A new axis adds its section here and its field to :class:`Parallelism`: nothing maps it anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

from lightning_dist.parallel import schedules
from lightning_dist.parallel.ac_modes import MODES as AC_MODES
from lightning_dist.parallel.ac_modes import OP_POLICY_NAMES

if TYPE_CHECKING:
    from lightning_dist.parallel_dims import ParallelDims

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
#: What the replica groups do when one is lost: restart the whole job, or train on and rejoin (torchft).
REPLICA_RECOVERIES = ("restart", "torchft")
#: FSDP2's gradient reduce-scatter / all-reduce dtype.
REDUCE_DTYPES = ("fp32", "bf16")
#: float8 training of the blocks' linear layers (torchao; :mod:`lightning_dist.parallel.float8`): one scale per
#: tensor (its FSDP2 all-gather in float8 too), one per row, or none.
FLOAT8_RECIPES = ("off", "tensorwise", "rowwise")


def _one_of(name: str, value: Any, allowed: tuple[Any, ...], what: str = "") -> None:
    if value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ValueError(f"parallelism.{name}={value!r} is unknown; use {shown}{what}.")


class _Options:
    """Immutable once built, as a frozen dataclass: each field is set by the dataclass ``__init__`` (and ``_check``
    may put it in its canonical form); setting one afterwards raises ``FrozenInstanceError``.

    Not ``@dataclass(frozen=True)``: OmegaConf makes a frozen dataclass's config node read-only, so Hydra could not
    compose the ``parallelism`` group's files and overrides into it; these classes are that group's schema.
    """

    _sealed = False

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "_sealed", True)

    def _check(self) -> None:
        """Check the fields (one line naming the field, its value and the fix), in place of ``__post_init__``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed:
            raise FrozenInstanceError(f"cannot assign to field {name!r} of {type(self).__name__}: use replace()")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and _values(self) == _values(other)

    def __hash__(self) -> int:
        return hash(tuple(repr(value) for value in _values(self)))  # a plan may be a dict: hashed by its repr


def _values(options: Any) -> tuple[Any, ...]:
    return tuple(getattr(options, f.name) for f in fields(options))


@dataclass(eq=False)
class TensorOptions(_Options):
    """``parallelism.tensor``: how tensor parallelism (``tp > 1``) splits the model."""

    sequence_parallel: bool = True
    """Shard norms and residuals along the sequence dim."""
    loss_parallel: bool = True
    """Compute the cross-entropy on vocab-sharded logits (no all-gather of logits)."""
    plan: Any = None
    """The plan to shard with instead of the model's own: a YAML / JSON file mapping module-name patterns (relative to
    the LightningModule, e.g. model.model.layers.*.self_attn.q_proj) to styles (colwise, rowwise, sequence,
    colwise_gather_output, rowwise_split_input, embedding_rowwise, replicated_with_grad_allreduce), or
    package.module:name of such a dict (or of a function returning one); in Python, the mapping itself (styles may be
    torch ParallelStyle objects)."""


@dataclass(eq=False)
class PipelineOptions(_Options):
    """``parallelism.pipeline``: how pipeline parallelism (``pp > 1``) splits and schedules the model."""

    schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
    (any case)."""
    microbatches: int | None = None
    """Microbatches per step, dividing the per-rank batch; None = pp x stages_per_rank."""
    stages_per_rank: int = 1
    """Virtual stages per rank (2 or more for the interleaved / looped / V schedules)."""
    split_points: tuple[str, ...] | None = None
    """Block names that start a new stage (e.g. [layers.2]); None = balanced by parameters."""

    def _check(self) -> None:
        # Canonical forms, so equal options compare equal: a tuple of split points, the schedule's own spelling.
        if self.split_points is not None and not isinstance(self.split_points, tuple):
            object.__setattr__(self, "split_points", tuple(self.split_points) or None)
        try:
            object.__setattr__(self, "schedule", schedules.resolve_schedule(self.schedule, self.stages_per_rank))
        except ValueError as err:
            raise ValueError(f"parallelism.pipeline.{err}") from None
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(
                f"parallelism.pipeline.microbatches={self.microbatches} must be >= 1, or null (pp x stages_per_rank)."
            )

    def num_microbatches(self, pp: int) -> int:
        """Microbatches per pipeline step: as set, else one per stage (``pp x stages_per_rank``)."""
        return self.microbatches if self.microbatches is not None else pp * self.stages_per_rank

    def check_microbatches(self, pp: int, per_rank_batch: int | None = None) -> None:
        """The microbatches against the schedule (torch's own requirements) and the per-rank batch."""
        try:
            schedules.check_microbatches(
                self.schedule, self.num_microbatches(pp), pp, self.stages_per_rank, per_rank_batch
            )
        except ValueError as err:
            raise ValueError(f"parallelism.pipeline.{err}") from None


@dataclass(eq=False)
class ContextOptions(_Options):
    """``parallelism.context``: how context parallelism (``cp > 1``) attends across the split sequence."""

    attention: str = "auto"
    """The attention across the cp group: auto (torch on CUDA, else allgather), allgather (all-gather of keys and
    values, the causal mask offset by each chunk's position; any device and backend, exact) or torch (torch's ring
    attention on CUDA's flash / efficient / cuDNN SDPA kernels). The start-up layout says which runs."""
    rotate: str = "allgather"
    """torch's ring attention: keys and values travel by one allgather or by alltoall (cp - 1 ring steps, each
    overlapping a block of attention); torch's set_rotate_method."""

    def _check(self) -> None:
        _one_of("context.attention", self.attention, CP_ATTENTIONS)
        _one_of("context.rotate", self.rotate, CP_ROTATES)
        if self.attention == "allgather" and self.rotate != "allgather":
            raise ValueError(
                f"parallelism.context.rotate={self.rotate} is for torch's ring attention but "
                "parallelism.context.attention=allgather runs the all-gather one; set context.attention=torch (or "
                "auto on CUDA), or context.rotate=allgather."
            )

    def resolve(self, device_type: str) -> str:
        """The cp attention that runs on ``device_type`` (``cpu``, ``cuda``; ``gpu`` is ``cuda``): ``auto`` is ``torch``
        on CUDA, else ``allgather``.

        torch's own context parallelism (2.13: ``torch.distributed.tensor.experimental``) routes only CUDA's flash,
        efficient and cuDNN SDPA kernels to its ring: on CPU the DTensor SDPA has no sharding rule at all.

        Raises:
            ValueError: ``torch`` off CUDA, or ``rotate=alltoall`` where the all-gather attention runs (one line each).
        """
        cuda = device_type in ("cuda", "gpu")
        if self.attention == "torch" and not cuda:
            raise ValueError(
                "parallelism.context.attention=torch runs torch's ring attention, whose kernels are CUDA's (flash / "
                f"efficient / cuDNN SDPA; torch 2.13), but the ranks run on {device_type}; set "
                "parallelism.context.attention=allgather or auto."
            )
        resolved = self.attention if self.attention != "auto" else "torch" if cuda else "allgather"
        if resolved == "allgather" and self.rotate != "allgather":
            raise ValueError(
                f"parallelism.context.rotate={self.rotate} is for torch's ring attention, but "
                f"parallelism.context.attention={self.attention} runs the all-gather attention on {device_type}; set "
                "parallelism.context.rotate=allgather."
            )
        return resolved


@dataclass(eq=False)
class FSDPOptions(_Options):
    """``parallelism.fsdp``: how FSDP2 (torch ``fully_shard``) shards and reduces over the data-parallel axes."""

    reduce_dtype: str | None = None
    """Reduce gradients in fp32 or bf16 (half the bytes, rounded sums); null = fp32 under mixed precision, else the
    parameters' dtype."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and optimizer state in host memory; needs dp_shard or dp_replicate > 1."""

    def _check(self) -> None:
        _one_of("fsdp.reduce_dtype", self.reduce_dtype, (*REDUCE_DTYPES, None), " (automatic)")


@dataclass(eq=False)
class DDPOptions(_Options):
    """``parallelism.ddp``: Lightning's DDP (``parallelism=ddp``)."""

    comm_hook: str | None = None
    """Compress the gradient all-reduce with torch's DDP hook: bf16, fp16 or powersgd (rank 1, error feedback, after
    1000 plain steps); null = full precision. Not exact: the sums are rounded."""

    def _check(self) -> None:
        _one_of("ddp.comm_hook", self.comm_hook, (*DDP_COMM_HOOKS, None), " (none)")


@dataclass(eq=False)
class DiLoCoOptions(_Options):
    """``parallelism.sync=diloco``: DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) on the
    ``dp_replicate`` axis (lightning_dist/parallel/diloco.py)."""

    every: int = 50
    """H: inner optimizer steps per outer step (per fragment)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """Outer SGD momentum (0 = none)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (needs outer_momentum > 0)."""
    fragments: int = 1
    """Streaming: F contiguous groups of blocks, each synchronized H/F steps after the previous (1 = plain DiLoCo)."""
    delay: int = 0
    """Streaming: tau, inner steps a fragment's all-reduce overlaps before it is applied (0 = blocking); below
    every // fragments."""
    alpha: float = 0.0
    """Streaming: mixing factor; new = (1 - alpha) x outer result + alpha x local parameters."""
    compression: str = "fp32"
    """The pseudo-gradient exchange: fp32, bf16 or int8 (per-block absmax scale, one fp32 scale per 256 values)."""

    def _check(self) -> None:
        every, fragments, delay, p = self.every, self.fragments, self.delay, "parallelism.diloco"
        if every < 1:
            raise ValueError(f"{p}.every={every} must be >= 1 (inner steps per outer step).")
        if not 1 <= fragments <= every:
            raise ValueError(
                f"{p}.fragments={fragments} must be in [1, {p}.every={every}] (fragments sync every/fragments steps "
                f"apart); lower it or raise {p}.every."
            )
        if not 0 <= delay < every // fragments:
            raise ValueError(
                f"{p}.delay={delay} must be in [0, every // fragments = {every // fragments}) so a fragment's "
                "exchange lands before the next fragment's; lower it."
            )
        if not self.outer_lr > 0:
            raise ValueError(f"{p}.outer_lr={self.outer_lr} must be > 0 (0.7 in the DiLoCo paper).")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"{p}.outer_momentum={self.outer_momentum} must be in [0, 1) (0.9: the paper).")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError(f"{p}.nesterov=true needs {p}.outer_momentum > 0; set one or {p}.nesterov=false.")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"{p}.alpha={self.alpha} must be in [0, 1] (0: take the outer result whole).")
        _one_of("diloco.compression", self.compression, COMPRESSIONS)


@dataclass(eq=False)
class ReplicaOptions(_Options):
    """``parallelism.replicas``: what the ``dp_replicate`` replica groups do when one of them is lost."""

    recovery: str = "restart"
    """restart (a lost rank ends the job; resilience.max_restarts starts every rank again from the newest checkpoint)
    or torchft (each replica group is a job of its own: the others train on without it, and a replaced group rejoins
    by copying a healthy group's state; pip install 'lightning-dist[ft]'; docs/how-to/failures.md)."""
    min_replicas: int = 1
    """recovery=torchft: the fewest replica groups a step commits with; fewer for longer than quorum_timeout_s stops
    the job."""
    lighthouse: str | None = None
    """recovery=torchft: the torchft Lighthouse's address (http://host:port); null = the app's launcher starts one
    (torchrun / srun: start torchft's own, torchft_lighthouse --min_replicas N, and give its address)."""
    group: int | None = None
    """recovery=torchft under torchrun / srun: this job's replica group (0 .. dp_replicate - 1); the app's launcher
    sets it for the groups it starts."""
    quorum_timeout_s: float = 60.0
    """recovery=torchft: how long a step waits for a quorum of min_replicas groups before the job stops."""
    heartbeat_timeout_s: float = 5.0
    """recovery=torchft, the Lighthouse the app starts: a group silent this long has left (the others go on)."""

    def _check(self) -> None:
        _one_of("replicas.recovery", self.recovery, REPLICA_RECOVERIES)
        if self.min_replicas < 1:
            raise ValueError(f"parallelism.replicas.min_replicas={self.min_replicas} must be >= 1.")
        if self.quorum_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError(
                f"parallelism.replicas.quorum_timeout_s={self.quorum_timeout_s} and heartbeat_timeout_s="
                f"{self.heartbeat_timeout_s} must be > 0 (seconds)."
            )

    @property
    def fault_tolerant(self) -> bool:
        """Whether the replica groups survive one another (``recovery=torchft``)."""
        return self.recovery == "torchft"


@dataclass(eq=False)
class ActivationCheckpointOptions(_Options):
    """``parallelism.activation_checkpointing.mode``: recompute activations in the backward instead of keeping them, for
    the blocks the module declares (``pipeline_spec()``), in whole models and pipeline stages alike."""

    mode: str = "none"
    """none, full (every block recomputed in backward) or selective (see selective)."""
    selective: str = "op"
    """mode=selective: op (keep matmul / attention outputs, recompute the rest), op_half (also recompute every second
    matmul: torchtitan's policy) or n (every n-th block fully)."""

    def _check(self) -> None:
        _one_of("activation_checkpointing.mode", self.mode, AC_MODES)
        selective = self.selective
        interval = selective.isdigit() and int(selective) >= 1
        if self.mode == "selective" and selective not in OP_POLICY_NAMES and not interval:
            raise ValueError(
                f"parallelism.activation_checkpointing.selective={selective!r}: use op (keep matmul outputs), op_half "
                "(keep every other matmul output) or a block interval n >= 1 (every n-th block fully checkpointed)."
            )


@dataclass(eq=False)
class Parallelism(_Options):
    """How the job is laid out over devices: the degrees (as :class:`~lightning_dist.ParallelDims` names them) and
    how each axis works. fsdp is FSDP2.

    Built by Hydra from the ``parallelism`` group (``parallelism.pipeline.schedule=GPipe``), or in Python by a
    strategy (``MeshStrategy(pp=2, schedule="GPipe")``: see :meth:`with_fields`).

    Raises:
        ValueError: One line naming the field, its value and the fix.
    """

    strategy: str = "ddp"
    """Strategy name: ddp (Lightning's DDP) or a mesh layout (fsdp, tensor_parallel, pipeline_parallel: our
    MeshStrategy). fsdp is FSDP2 (torch fully_shard), not Lightning's strategy="fsdp" (FSDP1)."""
    dp_replicate: int = 1
    """Data-parallel replicas (gradients all-reduced); -1 = the rest of the world size."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2, parameters sharded); -1 = the rest of the world size."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, head-tail balanced (data.seq_len divisible by
    2 x cp; the built-in GPT, arch=llama)."""
    ep: int = 1
    """Expert-parallel degree: each MoE block's experts split over ep of the dp_shard ranks (ep divides dp_shard and
    the number of experts), tokens sent to their experts and back by all-to-all; the experts FSDP2-sharded over the
    rest of dp_shard (and cp). Models with MoE blocks (model.moe.num_experts > 0, model=hf Mixtral / Qwen-MoE /
    OLMoE)."""
    tensor: TensorOptions = field(default_factory=TensorOptions)
    """tp > 1: sequence and loss parallelism, the plan."""
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    """pp > 1: the schedule, microbatches, virtual stages and split points."""
    context: ContextOptions = field(default_factory=ContextOptions)
    """cp > 1: the attention across the cp group."""
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """FSDP2 layouts: the gradient reduction dtype, CPU offload."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """parallelism=ddp: gradient compression hooks."""
    sync: str = "every_step"
    """How replicas (dp_replicate) stay together: every_step (gradients all-reduced, DDP / HSDP) or diloco (each
    replica trains alone and an outer step averages their progress every diloco.every steps)."""
    diloco: DiLoCoOptions = field(default_factory=DiLoCoOptions)
    """sync=diloco: the outer step's period, optimizer, fragments and compression."""
    replicas: ReplicaOptions = field(default_factory=ReplicaOptions)
    """dp_replicate > 1: whether a lost replica group ends the job or the others train on (torchft)."""
    activation_checkpointing: ActivationCheckpointOptions = field(default_factory=ActivationCheckpointOptions)
    """Activation checkpointing of the blocks: none, full or selective."""
    compile: bool = False
    """torch.compile each block (after TP and activation checkpointing, before FSDP2); needs a C++ compiler on CPU."""
    float8: str = "off"
    """float8 training of the blocks' linear layers (torchao, pip install 'lightning-dist[float8]'): tensorwise (one
    scale per tensor; FSDP2 all-gathers the weights in float8), rowwise (one scale per row) or off. Emulated where
    the GPU has no float8 matmuls (and on CPU); checkpoints keep the parameters' dtype."""
    loss_chunks: int = 0
    """Compute the head and the cross-entropy in this many pieces of the tokens, each recomputed in the backward:
    the (B, T, vocab) logits are never held whole (1/n of their memory, one more head matmul); 0 = off."""

    def _check(self) -> None:
        for name, value in vars(self).items():  # a section given as a mapping (Python users, a JSON record)
            kind = _SECTIONS.get(name)
            if kind is not None and isinstance(value, Mapping):
                object.__setattr__(self, name, _section(kind, name, value))
        _one_of("sync", self.sync, SYNCS, " (DDP / HSDP) or diloco")
        _one_of("float8", self.float8, FLOAT8_RECIPES)
        if self.loss_chunks < 0:
            raise ValueError(f"parallelism.loss_chunks={self.loss_chunks} must be >= 0 (0 = the plain loss).")

    @property
    def diloco_enabled(self) -> bool:
        """Whether the ``dp_replicate`` replicas train apart and meet in DiLoCo's outer steps."""
        return self.sync == "diloco"

    @property
    def degrees(self) -> dict[str, int]:
        """The requested degrees (``-1``: the rest of the world size), by axis name."""
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
        }

    def with_fields(self, **values: Any) -> Parallelism:
        """These options with ``values`` set: each name a field of :class:`Parallelism` (a section as its object or
        a mapping) or a field of exactly one section (``schedule="GPipe"`` sets ``pipeline.schedule``), so a strategy's
        keyword arguments read as the config's leaves.

        Raises:
            ValueError: A name that is no field, listing the known ones (one line).
        """
        top = {f.name for f in fields(self)}
        sections: dict[str, dict[str, Any]] = {}
        direct: dict[str, Any] = {}
        for name, value in values.items():
            if name in top:
                direct[name] = value
                continue
            owner = _LEAVES.get(name)
            if owner is None:
                known = sorted(top | set(_LEAVES))
                raise ValueError(f"{name} is not a parallelism option; the options are {', '.join(known)}.")
            sections.setdefault(owner, {})[name] = value
        for owner, leaves in sections.items():
            base = direct.pop(owner, getattr(self, owner))
            if isinstance(base, Mapping):
                base = _section(_SECTIONS[owner], owner, base)
            direct[owner] = replace(base, **leaves)
        return replace(self, **direct) if direct else self

    def check(self, dims: ParallelDims, per_rank_batch: int | None = None) -> None:
        """The rules that need the degrees as well; the pre-launch pass and the strategy both call this.

        Args:
            dims: The layout's degrees.
            per_rank_batch: The batch each data-parallel rank reads, when known (microbatches must divide it).

        Raises:
            ValueError: One line naming the values and the fix.
        """
        if self.compile and dims.tp_enabled:
            raise ValueError(compile_with_tp_error(dims.tp))
        if self.compile and dims.cp_enabled:
            raise ValueError(
                f"parallelism.compile=true with parallelism.cp={dims.cp}: compiled blocks with the context-parallel "
                "attention are not tested yet; set parallelism.compile=false or parallelism.cp=1."
            )
        if dims.ep_enabled and self.compile:
            raise ValueError(
                f"parallelism.compile=true with parallelism.ep={dims.ep}: the dropless all-to-all's split sizes are "
                "read back to the host in every MoE block, which a whole-graph compile of the block cannot hold; set "
                "parallelism.compile=false or parallelism.ep=1."
            )
        if dims.ep_enabled and self.diloco_enabled:
            raise ValueError(
                f"parallelism.sync=diloco with parallelism.ep={dims.ep}: DiLoCo's outer step over expert-parallel "
                "replicas is not written yet; set parallelism.sync=every_step or parallelism.ep=1."
            )
        if self.fsdp.cpu_offload and not dims.dp_cp_enabled:
            raise ValueError(
                f"parallelism.fsdp.cpu_offload=true needs FSDP2 shards to offload but the layout is {dims.describe()}; "
                "set parallelism.dp_shard > 1 (e.g. parallelism=fsdp) or parallelism.fsdp.cpu_offload=false."
            )
        if dims.pp_enabled:
            self.pipeline.check_microbatches(dims.pp, per_rank_batch)
        self._check_replicas(dims)
        if self.diloco_enabled and dims.dp_replicate < 2:
            raise ValueError(
                f"parallelism.sync=diloco averages replicas on dp_replicate but the layout is {dims.describe()}; set "
                "parallelism.dp_replicate >= 2 or parallelism.sync=every_step."
            )

    def _check_replicas(self, dims: ParallelDims) -> None:
        """The fault-tolerant replica axis against the degrees."""
        replicas = self.replicas
        if not replicas.fault_tolerant:
            return
        if dims.dp_replicate < 2:
            raise ValueError(
                f"parallelism.replicas.recovery=torchft keeps the other replica groups training when one is lost, but "
                f"the layout has dp_replicate={dims.dp_replicate}; set parallelism.dp_replicate >= 2."
            )
        if replicas.min_replicas > dims.dp_replicate:
            raise ValueError(
                f"parallelism.replicas.min_replicas={replicas.min_replicas} exceeds the {dims.dp_replicate} replica "
                "groups (dp_replicate): no step could ever commit; lower min_replicas or raise dp_replicate."
            )
        if self.diloco_enabled:
            raise ValueError(
                "parallelism.sync=diloco with parallelism.replicas.recovery=torchft: DiLoCo's outer step over "
                "torchft's replica groups is not written yet (torchft's own DiLoCo would replace ours); use one of "
                "them."
            )
        if replicas.group is not None and not 0 <= replicas.group < dims.dp_replicate:
            raise ValueError(
                f"parallelism.replicas.group={replicas.group} is not a replica group of dp_replicate="
                f"{dims.dp_replicate}; use 0 .. {dims.dp_replicate - 1}."
            )


#: Section field name -> its option class.
_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Parallelism) if is_dataclass(f.default_factory)}
#: A section's field name -> the section holding it (each name is in one section only).
_LEAVES: dict[str, str] = {leaf.name: name for name, kind in _SECTIONS.items() for leaf in fields(kind)}
assert len(_LEAVES) == sum(len(fields(kind)) for kind in _SECTIONS.values()), "a section field name is not unique"


def _section(kind: type, name: str, values: Mapping[str, Any]) -> Any:
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"parallelism.{name}.{unknown[0]} is not an option of parallelism.{name}; its options are "
            f"{', '.join(sorted(known))}."
        )
    return kind(**values)


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Raise a one-line ``ValueError`` when ``ep`` cannot split ``num_experts`` experts evenly."""
    if ep > 1 and num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"parallelism.ep={ep} does not divide the {num_experts} experts of each MoE block; use an ep in {divisors}."
        )


def compile_with_tp_error(tp: int) -> str:
    """Why compile and tensor parallelism are refused together (on torch 2.13; seen on CPU, every TP plan we have)."""
    return (
        f"parallelism.compile=true with parallelism.tp={tp}: torch's compiled backward of tensor-parallel blocks fails "
        "(a DTensor gradient arrives as a plain Tensor in redistribute's backward: AttributeError '_local_tensor'; "
        "cf. pytorch/pytorch#173123); use compile with tp=1 (fsdp, pp) or parallelism.compile=false."
    )
