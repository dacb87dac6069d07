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
:meth:`DiLoCo.after_inner_step` after each applied inner optimizer step and saves :meth:`DiLoCo.state_dict` per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
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
from lightning_dist.parallel.options import COMPRESSIONS, ParallelOptions


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
            f"diloco_fragments={num_fragments} but the model has {len(units_and_sizes)} {kind} to split; use at most "
            f"{len(units_and_sizes)}."
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


def describe(options: ParallelOptions) -> str:
    """One line such as ``DiLoCo over dp_replicate: H=50 F=1 tau=0 alpha=0 fp32``; ``""`` without DiLoCo."""
    if not options.diloco:
        return ""
    return (
        f"DiLoCo over dp_replicate: H={options.diloco_every} F={options.diloco_fragments} tau={options.diloco_delay} "
        f"alpha={options.diloco_alpha:g} {options.diloco_compression} (outer SGD lr={options.diloco_outer_lr:g} "
        f"momentum={options.diloco_outer_momentum:g}{' nesterov' if options.diloco_nesterov else ''})"
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
        fragments: Parameter names per fragment (:func:`build_fragments`); ``None`` = one fragment.
        every: H, inner steps per outer step of a fragment.
        outer_lr: Outer SGD learning rate.
        outer_momentum: Outer SGD momentum.
        nesterov: Nesterov momentum.
        delay: tau, inner steps between starting a fragment's exchange and applying it.
        alpha: Mixing factor: parameters = (1 - alpha) x outer result + alpha x local.
        compression: ``fp32``, ``bf16`` or ``int8``.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, Tensor]],
        group: dist.ProcessGroup | None,
        *,
        fragments: Sequence[Sequence[str]] | None = None,
        every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        delay: int = 0,
        alpha: float = 0.0,
        compression: str = "fp32",
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r} is unknown; use {', '.join(COMPRESSIONS)}.")
        self._params = dict(params)
        self.fragments = [list(f) for f in fragments] if fragments is not None else [list(self._params)]
        listed = [name for fragment in self.fragments for name in fragment]
        if sorted(listed) != sorted(self._params):
            raise ValueError("fragments must name every parameter exactly once; build them with build_fragments().")
        self.every, self.delay, self.alpha, self.compression = every, delay, alpha, compression
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
            list(self.backup.values()), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )
        if outer_momentum > 0:  # made now, so a saved state always has them (SGD's first step gives the same values)
            for tensor in self.backup.values():
                self.outer.state[tensor]["momentum_buffer"] = torch.zeros_like(tensor)

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, Tensor]],
        group: dist.ProcessGroup | None,
        options: ParallelOptions,
        blocks: Sequence[str] = (),
    ) -> DiLoCo:
        """A :class:`DiLoCo` with ``options``' ``diloco_*`` fields; fragments from ``blocks`` (or sizes) when F > 1."""
        fragments = None
        if options.diloco_fragments > 1:
            fragments = build_fragments([(n, p.numel()) for n, p in params], options.diloco_fragments, blocks)
        return cls(
            params, group, fragments=fragments, every=options.diloco_every, outer_lr=options.diloco_outer_lr,
            outer_momentum=options.diloco_outer_momentum, nesterov=options.diloco_nesterov,
            delay=options.diloco_delay, alpha=options.diloco_alpha, compression=options.diloco_compression,
        )  # fmt: skip

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
            delta = torch.cat([
                (self.backup[name].to(device, non_blocking=True) - local.float()).reshape(-1)
                for name, local in zip(names, locals_)
            ])  # fmt: skip
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
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: backup shards, outer SGD state, position in the cycle, byte counts, its own parameter
        shards (replicas differ between outer steps; a model checkpoint keeps one replica's) and each exchange in
        flight, waited for first (:meth:`finish_in_flight`) and kept with its due step, so a resume applies it when
        an uninterrupted run would have."""
        self.finish_in_flight()
        return {
            "step": self.step,
            "backup": {name: t.clone() for name, t in self.backup.items()},
            "outer": self.outer.state_dict(),
            "replica": {name: _local(p).detach().to("cpu", copy=True) for name, p in self._params.items()},
            "in_flight": {f: {"due": e.due, "average": e.mean.result().cpu()} for f, e in self._in_flight.items()},
            "bytes_last_sync": self.bytes_last_sync,
            "bytes_total": self.bytes_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this rank (same layout and fragments), parameters included.

        Raises:
            ValueError: The saved shards have other names or shapes (another layout: DiLoCo state does not reshard).
        """
        shapes = {name: tuple(t.shape) for name, t in state["backup"].items()}
        mine = {name: tuple(t.shape) for name, t in self.backup.items()}
        if shapes != mine:
            wrong = sorted(n for n in set(shapes) | set(mine) if shapes.get(n) != mine.get(n))
            raise ValueError(
                f"DiLoCo state holds other shards than this rank ({', '.join(wrong[:3])}); it does not reshard: "
                "resume with the layout that saved it."
            )
        self.step = int(state["step"])
        self.bytes_last_sync, self.bytes_total = int(state["bytes_last_sync"]), int(state["bytes_total"])
        with torch.no_grad():
            for name, tensor in state["backup"].items():
                self.backup[name].copy_(tensor)
            for name, tensor in state["replica"].items():
                _local(self._params[name]).copy_(tensor)
        self.outer.load_state_dict(state["outer"])
        self._in_flight = {  # each finished before the save: its mean restored as the result
            int(f): _Exchange(int(e["due"]), Mean(e["average"].numel(), self.compression, None, e["average"]))
            for f, e in state["in_flight"].items()
        }
        for exchange in self._in_flight.values():
            exchange.mean.value = exchange.mean.buffer

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
