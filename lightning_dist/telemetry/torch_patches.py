"""Where torch's communication enters Python, per torch version: the functions a CommTracker wraps, and the wrapping.

Kept apart from the tracker (:mod:`lightning_dist.telemetry.comm`) because this is the part a new torch release
changes: names move (``all_gather_into_tensor`` -> ``all_gather_single``), and the functional collectives live in a
private module (``torch.distributed._functional_collectives``, reached through ``_compat``).

Each wrapped function is looked up on its module at call time by torch itself (DTensor calls ``funcol.<name>``,
FSDP2 and Lightning call ``torch.distributed.<name>``), so replacing the module attributes sees every call. A
per-thread depth counter keeps calls made *inside* a tracked call (the ``isend`` calls of ``batch_isend_irecv``) from
being counted twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_dist._compat import functional_collectives_module


class Handler(Protocol):
    """What the wrappers hand calls to (a :class:`~lightning_dist.telemetry.comm.CommTracker`)."""

    enabled: bool

    def track(self, fn: Callable, spec: Spec, args: tuple, kwargs: dict, kind: str) -> Any: ...

    def track_batch_p2p(self, fn: Callable, p2p_ops: list) -> Any: ...


class Spec(NamedTuple):
    """Where a wrapped function keeps the tensor that defines the size, and its group."""

    op: str  # key in BUS_FACTORS
    tensor_pos: int
    tensor_kw: str
    group_pos: int
    group_kw: str
    times_group_size: bool = False  # size = tensor bytes x n (the input of a gather)


# torch.distributed functions. all_gather_single / reduce_scatter_single are the torch 2.13 names; the older
# *_into_tensor / *_tensor names (torch 2.11's only ones) are wrapped only when the new ones do not exist (in 2.13 they
# are deprecated aliases of them).
C10D_SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", 0, "tensor", 2, "group"),
    "broadcast": Spec("broadcast", 0, "tensor", 2, "group"),
    "reduce": Spec("reduce", 0, "tensor", 3, "group"),
    "all_gather_single": Spec("all_gather", 0, "output_tensor", 2, "group"),
    "all_gather": Spec("all_gather", 1, "tensor", 2, "group", times_group_size=True),
    "reduce_scatter_single": Spec("reduce_scatter", 1, "input", 3, "group"),
    "reduce_scatter": Spec("reduce_scatter", 1, "input_list", 3, "group"),
    "all_to_all_single": Spec("all_to_all", 1, "input", 4, "group"),
    "send": Spec("send", 0, "tensor", 2, "group"),
    "recv": Spec("recv", 0, "tensor", 2, "group"),
    "isend": Spec("send", 0, "tensor", 2, "group"),
    "irecv": Spec("recv", 0, "tensor", 2, "group"),
}
_C10D_FALLBACKS = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
_P2P = frozenset({"isend", "irecv"})

# Functional collectives (DTensor). Their results are AsyncCollectiveTensors, waited inside the wrapper.
FUNCOL_SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", 0, "self", 2, "group"),
    "broadcast": Spec("broadcast", 0, "self", 2, "group"),
    "all_gather_single": Spec("all_gather", 0, "self", 2, "group", times_group_size=True),
    "reduce_scatter_single": Spec("reduce_scatter", 0, "self", 3, "group"),
    "all_to_all_single": Spec("all_to_all", 0, "self", 3, "group"),
    "all_reduce_coalesced": Spec("all_reduce", 0, "self", 2, "group"),
    "all_gather_single_coalesced": Spec("all_gather", 0, "self", 1, "group", times_group_size=True),
    "reduce_scatter_single_coalesced": Spec("reduce_scatter", 0, "inputs", 3, "group"),
}
_FUNCOL_FALLBACKS = {
    "all_gather_single": "all_gather_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}


def c10d_name(name: str) -> str:
    """The name of the ``torch.distributed`` function torch 2.13 calls ``name`` (a key of :data:`C10D_SPECS`) on the
    installed torch: ``all_gather_single`` is ``all_gather_into_tensor`` on torch 2.11."""
    return name if hasattr(dist.distributed_c10d, name) else _C10D_FALLBACKS.get(name, name)


def funcol_name(name: str) -> str:
    """The name of the functional collective torch 2.13 calls ``name`` (a key of :data:`FUNCOL_SPECS`) on the
    installed torch: ``all_gather_single`` is ``all_gather_tensor`` on torch 2.11."""
    return name if hasattr(functional_collectives_module(), name) else _FUNCOL_FALLBACKS.get(name, name)


_HANDLER: Handler | None = None  # the installed tracker; the wrappers read it on every call
_PATCHES: list[tuple[ModuleType, str, Any]] = []  # (module, attribute, original) to restore on uninstall
_local = threading.local()  # .depth > 0 while inside a tracked call


def handler() -> Handler | None:
    """The installed handler, if any."""
    return _HANDLER


def depth() -> int:
    """How many tracked calls this thread is inside (0 = none)."""
    return getattr(_local, "depth", 0)


@contextmanager
def nested() -> Iterator[None]:
    """Mark the calls made inside as made from within a tracked call (not counted again)."""
    _local.depth = depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1


def argument(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    """A call's argument by position or keyword."""
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name)


# ------------------------------------------------------------------------------------------------------ patching
def _wrap(fn: Callable, spec: Spec, kind: str) -> Callable:
    def tracked(*args: Any, **kwargs: Any) -> Any:
        tracker = _HANDLER
        # The checks are the whole always-on cost when tracking is off: a global read and two attribute reads.
        if tracker is None or not tracker.enabled or depth() or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return tracker.track(fn, spec, args, kwargs, kind)

    tracked.__name__ = fn.__name__  # batch_isend_irecv tells sends from receives by op.op.__name__
    tracked.__qualname__ = fn.__qualname__
    tracked.__doc__ = fn.__doc__
    tracked.__wrapped__ = fn  # type: ignore[attr-defined]
    return tracked


def _wrap_batch(fn: Callable) -> Callable:
    def tracked(p2p_op_list: list) -> Any:
        tracker = _HANDLER
        if tracker is None or not tracker.enabled or depth() or torch.compiler.is_compiling():
            return fn(p2p_op_list)
        return tracker.track_batch_p2p(fn, p2p_op_list)

    tracked.__name__ = fn.__name__
    tracked.__wrapped__ = fn  # type: ignore[attr-defined]
    return tracked


def _set(modules: Sequence[ModuleType], name: str, value: Any) -> None:
    for module in modules:
        _PATCHES.append((module, name, getattr(module, name)))
        setattr(module, name, value)


def install(handler: Handler) -> None:
    """Wrap torch's base functions on every module that exposes them (same function object on each); the wrappers
    hand each call to ``handler`` until :func:`uninstall`."""
    global _HANDLER
    if _HANDLER is not None:
        raise RuntimeError("Another CommTracker is installed; uninstall it first (one tracker per process).")
    _HANDLER = handler
    c10d = dist.distributed_c10d
    # torch.distributed re-exports c10d's functions; torch's own helpers (batch_isend_irecv, P2POp's op check,
    # the deprecated aliases) call them through c10d's globals, user code and FSDP through torch.distributed.
    # Both must hold the same wrapper or P2POp(dist.isend, ...) fails c10d's `op in [isend, irecv]` check.
    for name, spec in C10D_SPECS.items():
        name = c10d_name(name)
        if not hasattr(c10d, name):
            continue
        wrapper = _wrap(getattr(c10d, name), spec, "p2p" if name in _P2P else "c10d")
        _set([m for m in (c10d, dist) if getattr(m, name, None) is getattr(c10d, name)], name, wrapper)
    batch = c10d.batch_isend_irecv
    _set(
        [m for m in (c10d, dist) if getattr(m, "batch_isend_irecv", None) is batch],
        "batch_isend_irecv",
        _wrap_batch(batch),
    )
    funcol = functional_collectives_module()
    for name, spec in FUNCOL_SPECS.items():
        name = funcol_name(name)
        if hasattr(funcol, name):
            _set([funcol], name, _wrap(getattr(funcol, name), spec, "funcol"))


def uninstall() -> None:
    """Put torch's functions back."""
    global _HANDLER
    _HANDLER = None
    while _PATCHES:
        module, name, original = _PATCHES.pop()
        setattr(module, name, original)


def register_ddp_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Route DDP's gradient all-reduce through ``torch.distributed.all_reduce`` so the tracker sees it.

    Uses torch's ``allreduce_hook`` (divide by the group size, all-reduce, the same result as DDP's built-in
    path). Returns False, and changes nothing, when the model already has a comm hook (DDP allows only one).
    """
    try:
        ddp_model.register_comm_hook(state=None, hook=allreduce_hook)
    except RuntimeError:  # "register_comm_hook ... can only be called once"
        return False
    return True
