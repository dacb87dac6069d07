"""Communication time, bytes and bus bandwidth per mesh axis, measured by intercepting torch's Python entry points.

Every parallelism we use reaches the network through a small set of Python functions that are looked up on their
module at call time, so replacing those module attributes while a :class:`CommTracker` is installed sees all of it:

- ``torch.distributed.<op>`` (and the same name in ``distributed_c10d``, which torch's own helpers call):
  ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather_single`` / ``all_gather_into_tensor``, ``all_gather``,
  ``reduce_scatter_single`` / ``reduce_scatter_tensor``, ``reduce_scatter``, ``all_to_all_single``, ``send``,
  ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``. FSDP2 (``fully_shard``), FSDP1 and Lightning's
  ``sync_dist`` call these; ``torch.distributed.pipelining`` calls ``isend`` / ``irecv`` / ``batch_isend_irecv``.
- ``torch.distributed._functional_collectives.<op>`` (private): ``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single`` (torch 2.11: ``all_gather_tensor``, ``reduce_scatter_tensor``), ``all_to_all_single``,
  ``broadcast``, the coalesced variants: what DTensor's placements and redistribute call (tensor parallelism, loss
  parallelism).
- DDP's reducer is C++; :func:`register_ddp_comm_hook` makes it go through ``torch.distributed.all_reduce``
  (torch's own ``allreduce_hook``, the same arithmetic as DDP's built-in all-reduce).

Only the base functions are wrapped (deprecated aliases call one through the module: counted there once); a
per-thread depth counter keeps calls made *inside* a tracked call (``batch_isend_irecv``'s ``isend``) from being
counted twice. A group whose ranks are both ``ep`` and a data-parallel axis (``ep = dp_shard``) reports its
all-to-alls under ``ep`` and the rest (FSDP2's) under ``dp``.

Counting (calls, bytes) is exact and always on. Timing can be switched per step (:attr:`CommTracker.timing`): an
untimed call goes straight through (no wait, no events), so the ``Telemetry`` callback times a sample of the steps
where timing is expensive (CPU) and counts every step.

Timing:

- CPU (gloo): the wrapper waits for an asynchronous collective before it returns, so the time is the collective's
  full duration. This serializes communication with compute on CPU (there is little overlap to lose there).
  Point-to-point ops are different: waiting inside ``isend`` could deadlock a pipeline schedule, so a lone
  ``isend`` / ``irecv`` returns a work object whose ``wait()`` is timed (the time counted is launch + the time the
  host was blocked in ``wait``), and so is each op of ``batch_isend_irecv``: a schedule posts its sends, computes
  and waits later, and waiting inside the wrapper would block both neighbours in their sends.
- CUDA: CUDA events around the call (no host sync); an asynchronous ``Work`` records its end event from a
  callback of its future, which runs once the collective finished on its stream; functional collectives are
  waited on the current stream (DTensor uses the result right away). Events are read in :meth:`CommTracker.flush`
  at logging time.

Bytes follow nccl-tests' "size": the buffer an all-reduce / broadcast / send reduces or moves, the *full* (gathered)
buffer of an all-gather and the full input of a reduce-scatter. Bus bandwidth uses nccl-tests' factors
(:data:`BUS_FACTORS`), so busbw compares with the link speed whatever the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat import resolve_process_group, wait_functional_collective
from lightning_dist.parallel_dims import DP, EP, REPORTED_AXES, REPORTED_AXIS
from lightning_dist.telemetry import torch_patches
from lightning_dist.telemetry.torch_patches import register_ddp_comm_hook as register_ddp_comm_hook  # re-exported

#: DiLoCo's outer exchange, reported apart (:meth:`CommTracker.apart`) so that its few large collectives are not mixed
#: into the per-step traffic on ``dp`` (with ``dp_shard=1`` torch hands out one group object for every data-parallel
#: axis, so the group alone cannot tell them apart).
OUTER_AXIS = "dp_replicate"
#: Axes in the order they are reported; ``world`` is the default group when it is no single axis, ``other`` is any
#: group the tracker was not told about.
AXIS_ORDER: tuple[str, ...] = (*REPORTED_AXES, OUTER_AXIS, "world", "other")

#: nccl-tests' bus-bandwidth factor for an op on a group of ``n`` ranks (busbw = size / time x factor).
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


@dataclass
class OpStats:
    """Totals for one (axis, op) pair on this rank."""

    count: int = 0
    bytes: int = 0  # nccl-tests "size", summed over calls
    seconds: float = 0.0  # of the timed calls only
    timed_count: int = 0
    timed_bus_bytes: float = 0.0  # bytes x bus factor of the timed calls: / seconds is nccl-tests' busbw

    def copy(self) -> OpStats:
        return OpStats(self.count, self.bytes, self.seconds, self.timed_count, self.timed_bus_bytes)

    def add(self, other: OpStats) -> None:
        self.count += other.count
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.timed_count += other.timed_count
        self.timed_bus_bytes += other.timed_bus_bytes

    def minus(self, other: OpStats) -> OpStats:
        return OpStats(
            self.count - other.count,
            self.bytes - other.bytes,
            self.seconds - other.seconds,
            self.timed_count - other.timed_count,
            self.timed_bus_bytes - other.timed_bus_bytes,
        )

    @property
    def busbw_gbps(self) -> float:
        """Achieved bus bandwidth of the timed calls in GB/s (1e9 bytes), 0 when no time was measured."""
        return self.timed_bus_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if obj is None:
        return 0
    return sum(_nbytes(item) for item in obj)


class _TimedWork:
    """A point-to-point ``Work`` whose ``wait()`` adds the time the host blocks in it to the op's seconds."""

    __slots__ = ("_stats", "_work")

    def __init__(self, work: Any, stats: OpStats) -> None:
        self._work = work
        self._stats = stats

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._stats.seconds += perf_counter() - start

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, exception, ...
        return getattr(self._work, name)


class CommTracker:
    """Counts calls, bytes and time of every collective and point-to-point op, per (axis, op).

    Args:
        axis_groups: Process groups of each axis, e.g. ``{"dp": [mesh["dp"].get_group()], "tp": [...]}``
            (see :func:`axis_groups_from_mesh`). ``None`` (Lightning's DDP / FSDP): the default group is ``dp``.
        device_type: ``"cuda"`` times with CUDA events; anything else with the host clock.
        timing: Initial value of :attr:`timing`.

    Use as a context manager, or :meth:`install` / :meth:`uninstall`. Only one tracker can be installed at a time.

    Attributes:
        timing: Time the calls made while it is True (count them either way). Set it per step to time a sample.
    """

    def __init__(
        self, axis_groups: Mapping[str, Sequence[Any]] | None = None, device_type: str = "cpu", timing: bool = True
    ):
        self.use_cuda_events = device_type == "cuda"
        self.enabled = True
        self.timing = timing
        self.stats: dict[tuple[str, str], OpStats] = {}
        self._pending: list[tuple[OpStats, Any, Any]] = []  # CUDA (stats, start, end) events not read yet
        self._axis_by_key: dict[Any, tuple[str, int]] = {}  # id(group) / group name -> (axis, group size)
        self._axis_by_ranks: dict[tuple[int, ...], str] = {}
        self._dp_ranks: set[tuple[int, ...]] = set()  # rank sets a data-parallel axis spans (see track)
        self._ep_is_dp: dict[Any, bool] = {}  # per ep group argument: whether its ranks are a data-parallel axis's
        self._keep_alive: list[Any] = []  # groups whose id() is a cache key must not be collected and reused
        self._world_axis = DP if axis_groups is None else None
        self._apart: tuple[str, Any] | None = None  # (axis, group) while inside apart()
        for axis, groups in (axis_groups or {}).items():
            for group in groups:
                self._register(REPORTED_AXIS.get(axis, axis), group)

    # ------------------------------------------------------------------------------------------ axis of a group
    def _register(self, axis: str, group: dist.ProcessGroup) -> None:
        size = group.size()
        self._axis_by_key.setdefault(id(group), (axis, size))
        self._axis_by_key.setdefault(group.group_name, (axis, size))
        self._keep_alive.append(group)
        if size > 1:  # size-1 groups of unused axes share rank sets; they move nothing anyway
            ranks = tuple(dist.get_process_group_ranks(group))
            self._axis_by_ranks.setdefault(ranks, axis)
            self._dp_ranks.update([ranks] if axis == DP else [])

    @contextmanager
    def apart(self, axis: str, group: dist.ProcessGroup) -> Iterator[None]:
        """Report the collectives issued inside on this very ``group`` object under ``axis``."""
        previous, self._apart = self._apart, (axis, group)
        try:
            yield
        finally:
            self._apart = previous

    def axis_of(self, group: Any) -> tuple[str, int]:
        """``(axis, group size)`` of a ``group`` argument as torch.distributed or the functional collectives take it.

        ``None`` is the default group; also accepted: a ProcessGroup, a group name, a 1-D DeviceMesh, a
        ``(DeviceMesh, dim)`` pair and a list of ranks. Unknown groups resolve by their ranks, else ``"other"``.
        """
        if self._apart is not None and group is self._apart[1]:
            return self._apart[0], group.size()
        key = id(group) if group is not None and not isinstance(group, str) else group
        found = self._axis_by_key.get(key)
        if found is None:
            found = self._resolve(group)
            self._axis_by_key[key] = found
            self._keep_alive.append(group)
        return found

    def _is_dp(self, group: Any) -> bool:
        """Whether ``group`` (resolved to ``ep``) spans a data-parallel axis's ranks too (cached by ``id``)."""
        if id(group) not in self._ep_is_dp:
            pg = dist.group.WORLD if group is None else group
            ranks = tuple(dist.get_process_group_ranks(pg)) if isinstance(pg, dist.ProcessGroup) else ()
            self._ep_is_dp[id(group)] = ranks in self._dp_ranks
        return self._ep_is_dp[id(group)]

    def _resolve(self, group: Any) -> tuple[str, int]:
        if isinstance(group, list):  # deprecated ranks form of the functional collectives
            ranks = tuple(group)
            return self._axis_by_ranks.get(ranks, "other"), len(ranks)
        if group is None:
            pg = dist.group.WORLD
        elif isinstance(group, dist.ProcessGroup):
            pg = group
        elif isinstance(group, str):
            pg = resolve_process_group(group)
        elif isinstance(group, tuple):  # (DeviceMesh, dim)
            pg = group[0].get_group(group[1])
        else:  # 1-D DeviceMesh
            pg = group.get_group()
        known = self._axis_by_key.get(id(pg)) or self._axis_by_key.get(pg.group_name)
        if known is not None:
            return known
        ranks = tuple(dist.get_process_group_ranks(pg))
        axis = self._axis_by_ranks.get(ranks)
        if axis is None:
            is_world = len(ranks) == dist.get_world_size()
            axis = (self._world_axis or "world") if is_world else "other"
        return axis, len(ranks)

    # ------------------------------------------------------------------------------------------------- control
    def install(self) -> CommTracker:
        """Replace torch's communication functions with tracking wrappers (idempotent for this tracker)."""
        if torch_patches.handler() is not self:
            torch_patches.install(self)
        return self

    def uninstall(self) -> None:
        """Put torch's functions back, and let go of the process groups the tracker has seen."""
        if torch_patches.handler() is self:
            torch_patches.uninstall()
        # A gloo group whose last reference dies after destroy_process_group() is destroyed outside torch's own
        # shutdown, and that hung a rank now and then (its destructor joins threads that wait for the GIL).
        # Forget the id-keyed entries with the objects: an id can be reused once the object is gone.
        self._keep_alive.clear()
        self._axis_by_key = {key: value for key, value in self._axis_by_key.items() if not isinstance(key, int)}

    def __enter__(self) -> CommTracker:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count what runs inside (the telemetry's own synchronization)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def flush(self) -> None:
        """Add the elapsed time of finished CUDA events to the totals (call at logging time, not every op)."""
        still_pending = []
        for stats, start, end in self._pending:
            try:
                end.synchronize()
                stats.seconds += start.elapsed_time(end) / 1e3
            except RuntimeError:  # the end event's callback has not run yet: read it next time
                still_pending.append((stats, start, end))
        self._pending = still_pending

    def snapshot(self) -> dict[tuple[str, str], OpStats]:
        """A copy of the totals so far (after :meth:`flush`)."""
        self.flush()
        return {key: stats.copy() for key, stats in self.stats.items()}

    # ------------------------------------------------------------------------------------------------ recording
    def _stats_for(self, axis: str, op: str) -> OpStats:
        stats = self.stats.get((axis, op))
        if stats is None:
            stats = self.stats[(axis, op)] = OpStats()
        return stats

    def track(self, fn: Callable, spec: torch_patches.Spec, args: tuple, kwargs: dict, kind: str) -> Any:
        """Count (and, while :attr:`timing`, time) one call of the wrapped ``fn``; the wrappers call this."""
        group = torch_patches.argument(args, kwargs, spec.group_pos, spec.group_kw)
        axis, size = self.axis_of(group)
        if axis == EP and spec.op != "all_to_all" and self._is_dp(group):
            axis = DP  # ep = dp_shard: one set of ranks; FSDP2's gathers and reductions are data-parallel traffic
        nbytes = _nbytes(torch_patches.argument(args, kwargs, spec.tensor_pos, spec.tensor_kw))
        if spec.times_group_size:
            nbytes *= size
        stats = self._stats_for(axis, spec.op)
        stats.count += 1
        stats.bytes += nbytes
        with torch_patches.nested():
            if not self.timing:  # counted only: the call runs (and overlaps) exactly as without the tracker
                return fn(*args, **kwargs)
            stats.timed_count += 1
            stats.timed_bus_bytes += nbytes * BUS_FACTORS[spec.op](size)
            if self.use_cuda_events:
                return self._call_cuda(fn, args, kwargs, kind, stats)
            start = perf_counter()
            out = fn(*args, **kwargs)
            if kind == "p2p":
                stats.seconds += perf_counter() - start
                return _TimedWork(out, stats) if out is not None else out
            if kind == "funcol":
                out = wait_functional_collective(out)
            elif isinstance(out, dist.Work):  # async_op=True
                out.wait()
            stats.seconds += perf_counter() - start
            return out

    def _call_cuda(self, fn: Callable, args: tuple, kwargs: dict, kind: str, stats: OpStats) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        if kind == "funcol":
            out = wait_functional_collective(out)  # a stream wait, not a host sync
            end.record()
        elif isinstance(out, dist.Work):
            # The future's callbacks run on a stream that waits for the collective: the event ends with it.
            out.get_future().then(lambda _: end.record())
        else:
            end.record()
        self._pending.append((stats, start, end))
        return out

    def track_batch_p2p(self, fn: Callable, p2p_ops: list) -> Any:
        """``batch_isend_irecv``: counted per direction, timed while it posts the ops (that time shared equally by
        them: torch 2.11's pipelining posts every batch here, 2.13's posts one-direction ones op by op) and when the
        caller waits. Never wait here: a pipeline schedule posts its sends, computes, and waits later; waiting
        inside the wrapper would block both neighbours in their sends (a deadlock with gloo)."""
        if not p2p_ops:
            return fn(p2p_ops)
        axis, _ = self.axis_of(p2p_ops[0].group)
        directions = ["send" if getattr(p2p.op, "__name__", "") == "isend" else "recv" for p2p in p2p_ops]
        for direction, p2p in zip(directions, p2p_ops):
            stats = self._stats_for(axis, direction)
            stats.count += 1
            stats.bytes += _nbytes(p2p.tensor)
            if self.timing:
                stats.timed_count += 1
                stats.timed_bus_bytes += _nbytes(p2p.tensor)
        start = perf_counter()
        with torch_patches.nested():
            works = fn(p2p_ops)
        if self.use_cuda_events or not self.timing:
            return works
        posting_s = (perf_counter() - start) / len(p2p_ops)
        for direction in directions:
            self._stats_for(axis, direction).seconds += posting_s
        if not works:
            return works
        if len(works) == len(p2p_ops):  # gloo: one work per op
            return [_TimedWork(w, self._stats_for(axis, d)) for w, d in zip(works, directions)]
        # A backend that coalesces the batch into one work: its wait is the receive (or the send, if none).
        return [_TimedWork(w, self._stats_for(axis, "recv" if "recv" in directions else "send")) for w in works]


# ------------------------------------------------------------------------------------------------------ helpers
#: Mesh axes in the order their groups are registered: a group object serves several axes only where they span the
#: same ranks (torch gives every world-spanning axis the default group), and is then named by the first: cp=2 on 2
#: ranks is ``cp`` (FSDP2's ``dp_shard_cp`` included), not ``dp``.
_REGISTER_ORDER = (
    *(a for a in REPORTED_AXIS if REPORTED_AXIS[a] != DP),
    *(a for a in REPORTED_AXIS if REPORTED_AXIS[a] == DP),
)


def axis_groups_from_mesh(mesh: Any, axes: Sequence[str] = _REGISTER_ORDER) -> dict:
    """``{reported axis: [process groups]}`` of the named axes of a DeviceMesh that has them."""
    groups: dict[str, list[dist.ProcessGroup]] = {}
    for axis in axes:
        try:
            group = mesh[axis].get_group()
        except (KeyError, RuntimeError, ValueError):  # axis absent from this mesh
            continue
        groups.setdefault(REPORTED_AXIS.get(axis, axis), []).append(group)
    return groups
