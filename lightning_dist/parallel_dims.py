"""ParallelDims: the single source of truth for the parallel layout.

Degrees use the same names everywhere (config fields, Python arguments, mesh axes):

- ``dp_replicate``: data-parallel replicas (DDP-style; gradients all-reduced).
- ``dp_shard``: data-parallel shards (FSDP2; parameters sharded, all-gathered per use).
- ``tp``: tensor parallel (DTensor; weights split inside a layer).
- ``pp``: pipeline parallel (layers split into stages).
- ``cp``: context parallel (each sequence split along its length; the ranks of one ``cp`` group read the same batch).
- ``ep``: expert parallel (an MoE block's experts split over ``ep`` ranks, tokens sent to their experts and back by
  all-to-all). The ``ep`` ranks are data-parallel ranks (``ep`` divides ``dp_shard``, as torchtitan's ``dp2ep``):
  they read different batches and share every other parameter; each expert is FSDP2-sharded over the rest of
  ``dp_shard`` (``efsdp = dp_shard / ep``) and ``cp``.

The device mesh is laid out ``(pp, dp_replicate, dp_shard, cp, tp)``: ``tp`` is innermost so that a tensor-parallel
group occupies neighbouring ranks (one node, the fastest links), ``cp`` next (its all-gather of keys and values runs
every layer), and ``pp`` outermost (cheapest traffic). FSDP2 shards over ``dp_shard x cp`` (the flattened axis
``dp_shard_cp``): cp ranks hold the same parameters, so their gradients are averaged like data-parallel ones.
With ``ep > 1`` the ``dp_shard`` axis is built from two, ``efsdp`` and ``ep`` (the mesh is
``(pp, dp_replicate, efsdp, cp, ep, tp)``: an expert-parallel group holds neighbouring ranks, and the experts' FSDP2
axis ``efsdp x cp`` is contiguous), and ``dp_shard`` is their flattening.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from lightning_dist._compat import flatten_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The registry of axis names: every list of axes in the package is derived from these.
#: Mesh axis names, outermost first.
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The data-parallel mesh axes (their ranks read different batches), flattened on the mesh into the axis ``DP``.
DP_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")
DP = "dp"
#: Flattened axes: FSDP2 shards over ``dp_shard x cp`` (``DP_SHARD_CP``); the loss is averaged over ``dp x cp``
#: (``DP_CP``: every rank that holds other tokens).
DP_SHARD_CP = "dp_shard_cp"
DP_CP = "dp_cp"
#: Expert parallelism (``ep > 1``): ``dp_shard`` is built as ``(EFSDP, EP)``; experts are split over ``EP`` and
#: FSDP2-sharded over ``EFSDP`` (``EFSDP_CP``: with ``cp``).
EP = "ep"
EFSDP = "efsdp"
EFSDP_CP = "efsdp_cp"
#: Mesh axis (flattened ones included) -> the axis its communication is reported under: the data-parallel axes, and
#: the flattened ones that span them, as ``DP`` (the experts' FSDP2 axes too); ``cp`` and ``ep`` as themselves.
REPORTED_AXIS: dict[str, str] = {axis: DP if axis in DP_AXES else axis for axis in (*AXES, DP)} | {
    DP_SHARD_CP: DP,
    DP_CP: DP,
    EP: EP,
    EFSDP: DP,
    EFSDP_CP: DP,
}
#: The axes communication is reported under (telemetry's ``comm/<axis>/``, the planner): ``DP``, ``EP``, then the
#: others innermost first, i.e. ``("dp", "ep", "tp", "cp", "pp")``.
REPORTED_AXES: tuple[str, ...] = (DP, EP, *(axis for axis in reversed(AXES) if axis not in DP_AXES))
#: The degrees of a layout: :class:`ParallelDims`' fields, the config's ``parallelism.<name>`` fields and the
#: strategies' arguments (one name each).
DEGREES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
#: Degrees that may be ``-1`` ("what the other degrees leave of the world size"); at most one at a time.
_FILLABLE: tuple[str, ...] = (*DP_AXES, "tp")


@dataclass
class ParallelDims:
    """Degrees of parallelism for a job of ``world_size`` processes.

    Args:
        world_size: Total number of processes.
        dp_replicate: Data-parallel replica degree; ``-1`` takes what the other degrees leave.
        dp_shard: Data-parallel shard (FSDP2) degree; ``-1`` takes what the other degrees leave.
        tp: Tensor-parallel degree; ``-1`` takes what the other degrees leave.
        pp: Pipeline-parallel degree.
        cp: Context-parallel degree: each sequence is split over ``cp`` ranks (not fillable with ``-1``).
        ep: Expert-parallel degree: an MoE block's experts are split over ``ep`` of the ``dp_shard`` ranks (it must
            divide ``dp_shard``; not fillable with ``-1``).

    Raises:
        ValueError: The degrees do not describe ``world_size`` processes; the message names the fix.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1; set cluster.devices (and num_nodes) >= 1.")
        if self.cp < 1:
            raise ValueError(f"cp={self.cp} must be >= 1; use cp=1 to turn context parallelism off.")
        if self.pp < 1:
            raise ValueError(f"pp={self.pp} must be >= 1; use pp=1 to turn pp off.")
        for name in _FILLABLE:
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise ValueError(f"{name}={value} must be >= 1, or -1 for 'the rest of the world size'.")
        rest = [name for name in _FILLABLE if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(
                f"{' and '.join(f'{name}=-1' for name in rest)}: only one data-parallel degree (or tp) can be "
                "'the rest'; set all but one of them to a number (usually dp_replicate=1)."
            )
        fixed = self.pp * self.cp * math.prod(max(getattr(self, name), 1) for name in _FILLABLE)
        if rest:
            if self.world_size % fixed != 0:
                raise ValueError(
                    f"{rest[0]}=-1 cannot fill world_size={self.world_size}: the other degrees multiply to {fixed}, "
                    f"which does not divide it; use a world size that is a multiple of {fixed} or change tp/pp."
                )
            setattr(self, rest[0], self.world_size // fixed)
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if product != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp} x tp={self.tp} x pp={self.pp} = "
                f"{product}, but world_size={self.world_size}; make the product equal the number of processes "
                f"(or set dp_shard=-1 to take the rest)."
            )
        if self.ep < 1:
            raise ValueError(f"ep={self.ep} must be >= 1; use ep=1 to turn expert parallelism off.")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp_shard={self.dp_shard} (world_size={self.world_size}): the "
                "expert-parallel ranks are data-parallel "
                f"(FSDP2) ranks that split the experts; use an ep dividing dp_shard, or raise dp_shard (dp_shard=-1 "
                "takes the rest of the world size)."
            )

    # ----------------------------------------------------------------------------------------------- degrees
    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups (ranks that see different batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        """Degree of each mesh axis, outermost first."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp_size(self) -> int:
        """Ranks that hold different tokens of a step (``dp x cp``): losses and metrics average over them."""
        return self.dp_size * self.cp

    @property
    def dp_cp_enabled(self) -> bool:
        """Whether gradients are synchronized at all (FSDP2 / replication over ``dp x cp``)."""
        return self.dp_cp_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one batch (``tp x pp``); throughput per device divides by this."""
        return self.tp * self.pp

    # ------------------------------------------------------------------------------- coordinates (no process group)
    def coordinates(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on each mesh axis (row-major over the axes as built: :meth:`built_axes`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}.")
        coords: dict[str, int] = {}
        for axis, degree in reversed(self.built_axes()):
            coords[axis] = rank % degree
            rank //= degree
        if self.ep > 1:  # dp_shard = (efsdp, ep), ep inner
            coords["dp_shard"] = coords.pop(EFSDP) * self.ep + coords.pop(EP)
        return {axis: coords[axis] for axis in AXES}

    def built_axes(self) -> list[tuple[str, int]]:
        """The device mesh's own axes and degrees, outermost first: ``AXES``, or with ``ep > 1``
        ``(pp, dp_replicate, efsdp, cp, ep, tp)``: ``dp_shard`` split into ``efsdp`` and ``ep``, with ``ep`` inside
        ``cp`` so that the experts' FSDP2 axis (``efsdp x cp``) is one contiguous block beside ``ep``."""
        degrees = self.degrees
        if self.ep == 1:
            return list(degrees.items())
        return [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            (EFSDP, self.dp_shard // self.ep),
            ("cp", self.cp),
            (EP, self.ep),
            ("tp", self.tp),
        ]

    def replica_group(self) -> ParallelDims:
        """One replica group's layout: every axis but ``dp_replicate``, over ``world_size / dp_replicate`` ranks (what
        each group of a fault-tolerant replica axis builds its mesh from: the groups meet through torchft)."""
        return ParallelDims(self.world_size // self.dp_replicate, 1, self.dp_shard, self.tp, self.pp, self.cp, self.ep)

    def dp_rank(self, rank: int) -> int:
        """Data-parallel index of ``rank``: ranks with the same index must read the same batches."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def ep_rank(self, rank: int) -> int:
        """Expert-parallel index of ``rank``: which ``1 / ep`` of each MoE block's experts it holds (the inner part of
        its ``dp_shard`` coordinate)."""
        return self.coordinates(rank)["dp_shard"] % self.ep

    def describe(self) -> str:
        """One line such as ``pp=1 dp_replicate=1 dp_shard=2 tp=2 (world 4)`` (``cp`` and ``ep`` shown when > 1)."""
        parts = " ".join(f"{axis}={degree}" for axis, degree in self.degrees.items() if axis != "cp" or degree > 1)
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"{parts}{ep} (world {self.world_size})"

    def check_seq_len(self, seq_len: int, name: str = "data.seq_len") -> None:
        """Raise a one-line ``ValueError`` when ``seq_len`` cannot be split over ``cp`` ranks (see
        :func:`check_context_parallel_seq_len`)."""
        check_context_parallel_seq_len(self.cp, seq_len, name)

    # ---------------------------------------------------------------------------------------------- device mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build (once) the 5-D device mesh with axes ``AXES``, the flattened axis ``dp`` (and when ``cp > 1``
        ``dp_shard_cp`` and ``dp_cp``), and Lightning's axis names.

        Needs an initialized default process group. Axes of degree 1 are kept so that ``mesh["tp"]`` etc. always
        exist; they cost nothing.
        """
        if self._mesh is None:
            # deferred: a rank builds the mesh; the launcher checks the degrees without torch (test_layering: DEFERRED)
            from torch.distributed.device_mesh import init_device_mesh

            names, sizes = zip(*self.built_axes())
            mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
            if self.ep > 1:
                flatten_mesh(mesh, (EFSDP, EP), "dp_shard")
            flatten_mesh(mesh, self._built(DP_AXES), DP)
            if self.cp > 1:  # at cp=1 they are dp_shard and dp: no second process group of the same ranks
                flatten_mesh(mesh, self._built(("dp_shard", "cp")), DP_SHARD_CP)
                flatten_mesh(mesh, self._built((*DP_AXES, "cp")), DP_CP)
                if self.ep > 1:
                    flatten_mesh(mesh, (EFSDP, "cp"), EFSDP_CP)
            # The names Lightning's ModelParallelStrategy gives its 2-D mesh, so a configure_model written for it
            # (Lightning's own examples) runs unchanged: device_mesh["data_parallel"], device_mesh["tensor_parallel"].
            flatten_mesh(mesh, self._built(DP_AXES), "data_parallel")
            flatten_mesh(mesh, ("tp",), "tensor_parallel")
            self._mesh = mesh
        return self._mesh

    def _built(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """``axes`` as the mesh was built (:meth:`built_axes`, in its order): ``dp_shard`` is ``(efsdp, ep)`` when
        ``ep > 1``."""
        if self.ep == 1:
            return axes
        wanted = {name for axis in axes for name in ((EFSDP, EP) if axis == "dp_shard" else (axis,))}
        return tuple(name for name, _ in self.built_axes() if name in wanted)

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh built by :meth:`build_mesh`."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.mesh was read before build_mesh(); the strategy builds it in setup.")
        return self._mesh

    @property
    def loss_axis(self) -> str:
        """The (flattened) mesh axis of the ranks holding other tokens of a step, which losses and metrics average
        over: ``dp``, or ``dp_cp`` when ``cp > 1``."""
        return DP_CP if self.cp > 1 else DP

    def group(self, axis: str):
        """The process group of this rank on mesh ``axis`` (``"pp"``, ``"tp"``, ``"dp"``, ...); needs the mesh."""
        return self.mesh[axis].get_group()

    @cached_property
    def fsdp_mesh_axes(self) -> tuple[str, ...]:
        """Axes FSDP2 shards over: ``dp_shard`` (``dp_shard_cp`` when ``cp > 1``: cp ranks share parameters and
        average gradients), with ``dp_replicate`` in front for HSDP / pure replication."""
        shard = DP_SHARD_CP if self.cp > 1 else "dp_shard"
        return ("dp_replicate", shard) if self.dp_replicate > 1 else (shard,)

    @cached_property
    def expert_fsdp_mesh_axes(self) -> tuple[str, ...]:
        """Axes FSDP2 shards the experts over when ``ep > 1``: ``efsdp`` (``efsdp_cp`` with cp), with
        ``dp_replicate`` in front; the ``ep`` ranks hold different experts, so the experts' data-parallel peers are
        the rest of ``dp_shard x cp``."""
        shard = EFSDP_CP if self.cp > 1 else EFSDP
        return ("dp_replicate", shard) if self.dp_replicate > 1 else (shard,)

    @property
    def expert_mesh_axes(self) -> tuple[str, ...]:
        """Axes an MoE block's experts are laid out on (the layout's ``ep`` and ``tp`` of size > 1): split over
        ``ep``, replicated over ``tp`` (whose ranks each run the experts on a part of the tokens)."""
        return tuple(axis for axis, size in ((EP, self.ep), ("tp", self.tp)) if size > 1)


def check_context_parallel_seq_len(cp: int, seq_len: int, name: str = "data.seq_len") -> None:
    """Raise a one-line ``ValueError`` unless ``seq_len`` splits into ``2 x cp`` equal chunks (head-tail balancing
    gives each cp rank one chunk from the front and its mirror from the back). Torch-free: the pre-launch check."""
    if cp > 1 and seq_len % (2 * cp):
        lower = seq_len - seq_len % (2 * cp)
        raise ValueError(
            f"{name}={seq_len} is not divisible by 2 x cp = {2 * cp} (context parallelism splits each sequence into "
            f"2 x cp chunks); use {name}={lower} or {lower + 2 * cp}, or another cp."
        )
