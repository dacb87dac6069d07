"""DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) over the ``dp_replicate`` axis.

Each replica (a ``dp_replicate`` coordinate) trains on its own batches with its own inner optimizer; nothing is
averaged over ``dp_replicate`` in the inner steps (FSDP2 shards over ``dp_shard`` only). Every H inner steps an outer
step brings the replicas together: each rank's pseudo-gradient ``backup - current`` (its own local shards) is averaged
over its ``dp_replicate`` group, an outer SGD (momentum, Nesterov) steps the backup with it, and the result is copied
into the parameters. The backup and the outer SGD's momentum live in host memory, sharded as the parameters are
(each rank keeps its local shards only).

Streaming DiLoCo splits the parameters into F contiguous fragments synchronized H/F steps apart (fragment f at inner
steps ``f * H // F + k * H``), so the exchange is spread out; with ``delay`` = tau > 0 a fragment's exchange is started
at its sync step and applied tau inner steps later (overlapping them), merged with the local parameters trained
meanwhile as ``(1 - alpha) x outer result + alpha x local``. F=1, tau=0, alpha=0 is plain DiLoCo, the same code path.

The pseudo-gradient travels as ``compression`` says (fp32 all-reduce; bf16 / int8 as an all-to-all reduce-scatter and
an all-gather of compressed chunks: :mod:`lightning_dist.parallel.compression`, with the error bounds); the bytes of
each exchange, in the telemetry's sizes, are :attr:`DiLoCo.bytes_last_sync`.

This module knows no Lightning: :class:`~lightning_dist.strategies.mesh.MeshStrategy` calls
:meth:`DiLoCo.after_inner_step` after each applied inner optimizer step and saves :meth:`DiLoCo.state_dict` (laid out
like the parameters, so it reshards) through DCP beside each replica's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.parallel.compression import (  # noqa: F401  (re-exported: the exchange's public helpers)
    INT8_BLOCK,
    Mean,
    compress,
    decompress,
    dequantize_int8,
    exchange_sizes,
    payload_bytes,
    quantize_int8,
    start_mean,
)
from lightning_dist.parallel.options import DiLoCoOptions


# ----------------------------------------------------------------------------------------------------- fragments
def build_fragments(
    named_sizes: Sequence[tuple[str, int]], num_fragments: int, blocks: Sequence[str] = ()
) -> list[list[str]]:
    """Split parameter names (in model order) into ``num_fragments`` contiguous groups of about equal size.

    With ``blocks`` (module names such as ``layers.0``, from ``pipeline_spec()``) whole blocks are the units: a
    parameter outside every block joins the unit before it (the first, for those before any block). Sizes should be
    whole-tensor element counts so every rank draws the same fragments.

    Raises:
        ValueError: More fragments than units (blocks, or parameters without blocks).
    """
    units: list[list[str]] = []
    sizes: list[int] = []
    current = -1
    for name, size in named_sizes:
        owner = next((i for i, b in enumerate(blocks) if name.startswith(f"{b}.")), None)
        if owner is None and blocks:
            owner = max(current, 0)
        elif owner is None:
            owner = len(units)  # no blocks: every parameter is a unit
        while len(units) <= owner:
            units.append([])
            sizes.append(0)
        units[owner].append(name)
        sizes[owner] += size
        current = owner
    units_and_sizes = [(u, s) for u, s in zip(units, sizes) if u]
    kind = "blocks" if blocks else "parameters"
    if num_fragments > len(units_and_sizes):
        raise ValueError(
            f"parallelism.diloco.fragments={num_fragments} but the model has {len(units_and_sizes)} {kind} to split; "
            f"use at most {len(units_and_sizes)}."
        )
    total = sum(s for _, s in units_and_sizes)
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    done, f = 0, 0
    for i, (unit, size) in enumerate(units_and_sizes):
        left = len(units_and_sizes) - i
        # next fragment when this unit would overshoot the share more than stopping short does, or when each
        # fragment still to fill needs one of the units left
        target = total * (f + 1) / num_fragments
        closer = abs(done - target) <= abs(done + size - target)
        if fragments[f] and f < num_fragments - 1 and (closer or left <= num_fragments - 1 - f):
            f += 1
        fragments[f].extend(unit)
        done += size
    return fragments


def describe(options: DiLoCoOptions) -> str:
    """One line such as ``DiLoCo over dp_replicate: H=50 F=1 tau=0 alpha=0 fp32 (outer SGD ...)``."""
    o = options
    return (
        f"DiLoCo over dp_replicate: H={o.every} F={o.fragments} tau={o.delay} alpha={o.alpha:g} {o.compression} "
        f"(outer SGD lr={o.outer_lr:g} momentum={o.outer_momentum:g}{' nesterov' if o.nesterov else ''})"
    )


# ---------------------------------------------------------------------------------------------------- the rule
@dataclass
class _Exchange:
    """One fragment's pseudo-gradient exchange, in flight until ``due`` (an inner step)."""

    due: int
    mean: Mean  # the pseudo-gradients' mean in flight (or restored from a checkpoint, already finished)


class DiLoCo:
    """DiLoCo's outer loop for this rank's parameter shards over its ``dp_replicate`` group.

    Args:
        params: This rank's ``(name, parameter)`` pairs in model order (DTensors or plain tensors).
        group: The ``dp_replicate`` process group; ``None`` = no communication (one replica).
        options: H, the outer SGD, tau, alpha and the compression (:class:`~lightning_dist.parallel.options.
            DiLoCoOptions`, checked on construction); keyword arguments set single fields over them.
        fragments: Parameter names per fragment (:func:`build_fragments`); ``None`` = one fragment.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, Tensor]],
        group: dist.ProcessGroup | None,
        options: DiLoCoOptions | None = None,
        *,
        fragments: Sequence[Sequence[str]] | None = None,
        **fields: Any,
    ) -> None:
        options = replace(options or DiLoCoOptions(), **fields)
        self._params = dict(params)
        self.fragments = [list(f) for f in fragments] if fragments is not None else [list(self._params)]
        listed = [name for fragment in self.fragments for name in fragment]
        if sorted(listed) != sorted(self._params):
            raise ValueError("fragments must name every parameter exactly once; build them with build_fragments().")
        self.options = options
        every = options.every
        self.every, self.delay, self.alpha, self.compression = every, options.delay, options.alpha, options.compression
        self.offsets = [f * every // len(self.fragments) for f in range(len(self.fragments))]
        self.group = group
        self.num_replicas = dist.get_world_size(group) if group is not None else 1
        self.step = 0  #: inner steps taken (the position in the cycle)
        self.bytes_last_sync = 0  #: bytes this rank sent in its latest fragment exchange
        self.bytes_total = 0  #: bytes this rank sent in every exchange so far
        self._in_flight: dict[int, _Exchange] = {}
        #: What a step's outer work (exchanges started or applied) runs inside: telemetry's timer, else nothing.
        self.timer: Callable[[], AbstractContextManager[Any]] = nullcontext
        with torch.no_grad():
            if group is not None:  # the replicas must start equal, however each built its model
                for local in self._locals():
                    dist.broadcast(local, group=group, group_src=0)
            # fp32 on the host, sharded as the parameters: the outer state costs no accelerator memory
            self.backup = {name: _local(p).detach().to("cpu", torch.float32, copy=True) for name, p in params}
        self.outer = torch.optim.SGD(
            list(self.backup.values()), lr=options.outer_lr, momentum=options.outer_momentum, nesterov=options.nesterov
        )
        # Momentum buffers made now, so a saved state always has them (SGD's first step gives the same values).
        if options.outer_momentum > 0:
            for tensor in self.backup.values():
                self.outer.state[tensor]["momentum_buffer"] = torch.zeros_like(tensor)

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, Tensor]],
        group: dist.ProcessGroup | None,
        options: DiLoCoOptions,
        blocks: Sequence[str] = (),
    ) -> DiLoCo:
        """A :class:`DiLoCo` with ``options``; fragments from ``blocks`` (or sizes) when F > 1."""
        fragments = None
        if options.fragments > 1:
            fragments = build_fragments([(n, p.numel()) for n, p in params], options.fragments, blocks)
        return cls(params, group, options, fragments=fragments)

    def syncs_at(self, step: int) -> list[int]:
        """The fragments whose exchange starts after inner step ``step`` (1-based)."""
        return [f for f, offset in enumerate(self.offsets) if (step - offset) % self.every == 0]

    # ------------------------------------------------------------------------------------------------ the step
    def after_inner_step(self) -> None:
        """Count one applied inner optimizer step; run the outer steps (fragments) due after it, inside
        :attr:`timer`."""
        self.step += 1
        due = [f for f, exchange in sorted(self._in_flight.items()) if exchange.due == self.step]
        starting = self.syncs_at(self.step)
        if not due and not starting:
            return
        with self.timer():
            for f in due:
                self._apply(f)
            for f in starting:
                self._start(f)
                if self.delay == 0:
                    self._apply(f)

    def _start(self, f: int) -> None:
        names = self.fragments[f]
        with torch.no_grad():
            locals_ = [_local(self._params[name]) for name in names]
            device = locals_[0].device
            delta = torch.cat(
                [
                    (self.backup[name].to(device, non_blocking=True) - local.float()).reshape(-1)
                    for name, local in zip(names, locals_)
                ]
            )
        sizes = exchange_sizes(delta.numel(), self.compression, self.num_replicas)
        self.bytes_last_sync = sum(size for _, size in sizes) if self.group is not None else 0
        self.bytes_total += self.bytes_last_sync
        mean = start_mean(delta, self.group, self.compression)
        self._in_flight[f] = _Exchange(due=self.step + self.delay, mean=mean)

    def _apply(self, f: int) -> None:
        average = self._in_flight.pop(f).mean.result().to("cpu")
        names = self.fragments[f]
        start = 0
        for name in names:
            backup = self.backup[name]
            backup.grad = average[start : start + backup.numel()].view_as(backup)
            start += backup.numel()
        self.outer.step()  # parameters without a gradient (other fragments) are left alone
        with torch.no_grad():
            for name in names:
                local = _local(self._params[name])
                result = self.backup[name].to(local.device, non_blocking=True)
                if self.alpha:
                    result = (1 - self.alpha) * result + self.alpha * local.float()
                local.copy_(result)
                self.backup[name].grad = None

    def finish_in_flight(self) -> None:
        """Wait for every exchange in flight (its result is kept and applied at its due step, not earlier)."""
        for exchange in self._in_flight.values():
            exchange.mean.result()

    # ---------------------------------------------------------------------------------------------- checkpoints
    @property
    def replicas_equal(self) -> bool:
        """Whether every replica holds the same parameters now: before the first inner step, or right after an outer
        step was applied to the whole model (one fragment, alpha = 0, nothing in flight)."""
        if self.step == 0:
            return True
        applied = self.step >= self.every and (self.step - self.delay) % self.every == 0
        return len(self.fragments) == 1 and self.alpha == 0 and applied and not self._in_flight

    def state_dict(self) -> dict[str, Any]:
        """The outer state, each tensor laid out like its parameter (a DTensor of the same mesh and placements around
        this rank's shard in host memory), so that DCP reshards it to any inner layout: ``backup``, ``momentum``
        (outer SGD's, when it has any), ``average`` (each exchange in flight, waited for first and split by
        parameter), ``fragment`` (each parameter's, when F > 1), and ``step`` and ``in_flight`` (fragment -> the
        inner step it is applied at, as an uninterrupted run would). Backup, momentum and averages are the same on
        every replica; the parameters and inner optimizer state, which differ, are the strategy's to save."""
        self.finish_in_flight()
        averages = {f: exchange.mean.result().cpu() for f, exchange in self._in_flight.items()}
        state = self._tensors(averages, momentum=self.momentum is not None, copy=True)
        return {"step": self.step, "in_flight": {f: e.due for f, e in self._in_flight.items()}, **state}

    def empty_state(self, in_flight: Sequence[int], momentum: bool) -> dict[str, Any]:
        """Tensors laid out as :meth:`state_dict`'s, for DCP to load a saved state into (``in_flight``: the saved
        fragments in flight; ``momentum``: whether it has outer momentum)."""
        empty = {
            f: torch.empty(sum(self.backup[n].numel() for n in self.fragments[f]), device="cpu") for f in in_flight
        }
        return self._tensors(empty, momentum=momentum and self.momentum is not None, copy=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (loaded into :meth:`empty_state`'s tensors, from any inner layout).
        Without ``momentum`` the outer momentum starts at zero. The byte counts become those this layout would have
        sent up to the saved step.

        Raises:
            ValueError: A parameter was in another fragment when saved (another pp split with F > 1).
        """
        for name, saved in state.get("fragment", {}).items():
            mine = next(f for f, names in enumerate(self.fragments) if name in names)
            if int(_local(saved)[0]) != mine:
                raise ValueError(
                    f"the checkpoint's DiLoCo state has {name} in fragment {int(_local(saved)[0])} and this layout in "
                    f"fragment {mine} (pipeline stages split the fragments); resume with the pp degree and stages "
                    "that saved it, or parallelism.diloco.fragments=1."
                )
        self.step = int(state["step"])
        with torch.no_grad():
            for name, tensor in state["backup"].items():
                self.backup[name].copy_(_local(tensor))
            for name, buffer in (self.momentum or {}).items():
                if "momentum" in state:
                    buffer.copy_(_local(state["momentum"][name]))
                else:
                    buffer.zero_()
        self._in_flight = {}
        for f, due in state["in_flight"].items():  # each finished before the save: its mean restored as the result
            flat = torch.cat([_local(state["average"][name]).reshape(-1) for name in self.fragments[int(f)]])
            self._in_flight[int(f)] = _Exchange(int(due), Mean(flat.numel(), self.compression, None, flat, value=flat))
        self._recount()

    @property
    def momentum(self) -> dict[str, Tensor] | None:
        """The outer SGD's momentum buffer per parameter name (host, sharded as the backup); ``None`` without."""
        if not self.outer.state:
            return None
        return {name: self.outer.state[backup]["momentum_buffer"] for name, backup in self.backup.items()}

    def _tensors(self, averages: dict[int, Tensor], momentum: bool, copy: bool) -> dict[str, Any]:
        def like(name: str, local: Tensor) -> Tensor:
            return _like(self._params[name], local, copy)

        state: dict[str, Any] = {"backup": {name: like(name, t) for name, t in self.backup.items()}}
        if momentum:
            state["momentum"] = {name: like(name, t) for name, t in (self.momentum or {}).items()}
        state["average"] = {}
        for f, flat in averages.items():
            start = 0
            for name in self.fragments[f]:
                shape = self.backup[name].shape
                state["average"][name] = like(name, flat[start : start + shape.numel()].view(shape))
                start += shape.numel()
        if len(self.fragments) > 1:
            state["fragment"] = {
                n: torch.tensor([f], device="cpu") for f, names in enumerate(self.fragments) for n in names
            }
        return state

    def _exchange_bytes(self, f: int) -> int:
        """The bytes this rank sends in one exchange of fragment ``f`` (none without a group)."""
        if self.group is None:
            return 0
        numel = sum(self.backup[name].numel() for name in self.fragments[f])
        return sum(size for _, size in exchange_sizes(numel, self.compression, self.num_replicas))

    def _recount(self) -> None:
        """The byte counts of every exchange started up to :attr:`step` (fragment f starts at offset_f + k H)."""
        self.bytes_total = self.bytes_last_sync = 0
        latest = 0
        for f, offset in enumerate(self.offsets):
            first = offset or self.every  # offset 0: the first exchange is after inner step H
            if self.step < first:
                continue
            starts = (self.step - first) // self.every + 1
            self.bytes_total += starts * self._exchange_bytes(f)
            if first + (starts - 1) * self.every > latest:
                latest, self.bytes_last_sync = first + (starts - 1) * self.every, self._exchange_bytes(f)

    def reset(self) -> None:
        """Start a fresh cycle from the current parameters (after loading weights without DiLoCo state)."""
        self._in_flight.clear()
        self.step = 0
        with torch.no_grad():
            for name, p in self._params.items():
                self.backup[name].copy_(_local(p))
            for state in self.outer.state.values():
                if "momentum_buffer" in state:
                    state["momentum_buffer"].zero_()

    def _locals(self) -> list[Tensor]:
        return [_local(p) for p in self._params.values()]


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (shares its storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _like(param: Tensor, local: Tensor, copy: bool) -> Tensor:
    """A tensor laid out like ``param`` holding ``local`` (its shard's shape, in host memory): a DTensor of ``param``'s
    mesh and placements whose shard stays on the host (not moved to the mesh's device), filled with ``local`` when
    ``copy``; for a plain parameter ``local`` itself, or its copy."""
    if not hasattr(param, "to_local"):
        return local.clone() if copy else local
    out = torch.empty_like(param, device=local.device, dtype=local.dtype)  # a DTensor: param's spec, a host shard
    if copy:
        out.to_local().copy_(local)
    return out
