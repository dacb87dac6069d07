"""Context parallelism: each sequence split over the ``cp`` ranks, attention computed across them.

No Lightning, no model code. A model takes part through a :class:`ContextParallelSpec` (which of its modules hold
an attention function, which of its buffers are per-position tables, or which module takes ``position_ids``);
:func:`apply_context_parallel` replaces those functions and re-indexes those tables (or passes this rank's global
positions), and the strategy splits each batch with :func:`shard_batch`.

Load balancing (head-tail): the sequence is cut into ``2 x cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so under a causal mask every rank attends over the same number of (query, key) pairs.

The attention across the cp group (``allgather``, torch's ring ``torch``, or ``auto``) is
:mod:`lightning_dist.parallel.context_attention`'s. Everything :func:`apply_context_parallel` changes is recorded, so
:func:`undo_context_parallel` gives the module its own attention and positions back (a later use without cp computes
as before), and what it returns makes the changes again (the strategy does both around its loops).
"""

from __future__ import annotations

import fnmatch
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_dist.parallel.context_attention import AllGatherAttention as AllGatherAttention  # re-exported
from lightning_dist.parallel.context_attention import TorchRingAttention, build_attention, head_tail_positions
from lightning_dist.parallel.options import ContextOptions
from lightning_dist.parallel_dims import check_context_parallel_seq_len


@dataclass(frozen=True)
class ContextParallelSpec:
    """How a model takes part in context parallelism (module names relative to the module being parallelized).

    Attributes:
        attention: ``fnmatch`` patterns of the modules whose attribute ``attention_attr`` is the attention function
            ``fn(q, k, v) -> out`` with ``q`` (B, H, T, D), ``k`` / ``v`` (B, K, T, D) (K dividing H: grouped-query
            attention), causal over T; the context-parallel attention (which also takes ``scale=``, default
            ``D ** -0.5``) replaces it.
        attention_attr: Name of that attribute.
        positions: The module whose ``forward`` takes the (sharded) batch's inputs first, shape (B, T_local, ...),
            and whose buffers ``position_tables`` have one row per position (e.g. RoPE tables sliced ``[:T]``).
            Around each of its forwards the tables are replaced by the rows of this rank's global positions, so local
            index ``i`` gets the position ``p(i)`` it has in the whole sequence. ``None``: no per-position tables.
        position_tables: Buffer names of ``positions`` (e.g. ``("rope_cos", "rope_sin")``).
        position_ids: The module whose ``forward`` takes a ``position_ids=`` keyword (a HuggingFace model): a call
            that passes none gets this rank's global positions (1, T_local), T_local being dim 1 of its first
            argument (or keyword) of two or more dims. ``None``: no such module.
        prepare: Called with the module before its attention functions are replaced (e.g. to route a HuggingFace
            model's attention through the attribute ``attention_attr``); ``None``: nothing to prepare.
    """

    attention: tuple[str, ...]
    attention_attr: str = "attention_fn"
    positions: str | None = None
    position_tables: tuple[str, ...] = ()
    position_ids: str | None = None
    prepare: Callable[[nn.Module], None] | None = None


# ------------------------------------------------------------------------------------------- the sequence split
def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This cp rank's part of ``x`` along ``dim`` (its head and tail chunks, concatenated)."""
    check_context_parallel_seq_len(cp, x.shape[dim], "the sequence length")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def unshard_sequence(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every cp rank's part (rank order), in the original order: the inverse of
    :func:`shard_sequence`."""
    halves = [part.chunk(2, dim=dim) for part in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def gather_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """All-gather every cp rank's part of ``x`` (no gradient) and return the whole sequence in its order; a DTensor
    (e.g. vocab-sharded logits under tensor parallelism) keeps its mesh and placements."""
    if isinstance(x, DTensor):
        whole = gather_sequence(x.to_local(), group, dim)
        return DTensor.from_local(whole, x.device_mesh, x.placements, run_check=False)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim=dim)


def sequence_length(batch: Any) -> int | None:
    """The batch's sequence length: dim 1 of its first tensor with at least two dims (the inputs), else ``None``."""
    for tensor in _tensors(batch):
        if tensor.ndim >= 2:
            return tensor.shape[1]
    return None


def shard_batch(batch: Any, cp: int, rank: int) -> Any:
    """This cp rank's part of a batch: every tensor (in nested tuples, lists and dicts) whose dim 1 equals the
    sequence length (dim 1 of the first tensor of two or more dims, the inputs) is cut with :func:`shard_sequence`;
    every other value is kept as it is. So ``(inputs, targets)`` of shape (B, T) become (B, T / cp) each.

    Raises:
        ValueError: No tensor of two or more dims was found, or the sequence length is not divisible by ``2 x cp``
            (one line each).
    """
    if cp == 1:
        return batch
    seq_len = sequence_length(batch)
    if seq_len is None:
        raise ValueError(
            f"cp={cp} splits the batch's (B, T) tensors but found none in a {type(batch).__name__}; give the "
            "batch as tensors in tuples, lists or dicts, or set cp=1."
        )
    check_context_parallel_seq_len(cp, seq_len, "the batch's sequence length (dim 1 of its first tensor)")
    return _map_tensors(batch, lambda t: shard_sequence(t, cp, rank) if t.ndim >= 2 and t.shape[1] == seq_len else t)


def gather_outputs(outputs: Any, local_len: int, group: dist.ProcessGroup) -> Any:
    """``outputs`` (nested tuples, lists, dicts) with every tensor whose dim 1 is ``local_len`` gathered back to the
    whole sequence in its order (e.g. predicted logits (B, T / cp, V) -> (B, T, V)); the rest kept."""
    return _map_tensors(outputs, lambda t: gather_sequence(t, group) if t.ndim >= 2 and t.shape[1] == local_len else t)


def _tensors(obj: Any) -> list[Tensor]:
    found: list[Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((key, _map_tensors(value, fn)) for key, value in obj.items())
    if type(obj) in (tuple, list):  # not their subclasses (a namedtuple's constructor takes fields)
        return type(obj)(_map_tensors(value, fn) for value in obj)
    return obj


# ----------------------------------------------------------------------------------------------- applying it
def apply_context_parallel(
    module: nn.Module,
    spec: ContextParallelSpec,
    group: DeviceMesh | dist.ProcessGroup,
    options: ContextOptions | None = None,
) -> str:
    """Make ``module`` compute on this cp rank's part of each sequence: replace its attention functions and index its
    position tables by this rank's global positions. In place, undone by :func:`undo_context_parallel`; the batch is
    split by the caller (:func:`shard_batch`).

    Args:
        module: The module to change; ``spec``'s names are relative to it.
        spec: Which modules and buffers take part.
        group: The 1-D cp mesh (a process group: its device type is ``cuda`` under nccl, else ``cpu``).
        options: The attention (``auto``, ``allgather`` or ``torch``: :mod:`~lightning_dist.parallel.context_attention`)
            and torch's ring rotation; ``None`` = the defaults.

    Returns:
        What runs, in words (for ``describe()``).

    Raises:
        ValueError: An attention that cannot run here, or a pattern that matches no module (one line each).
    """
    if not isinstance(group, DeviceMesh):
        group = DeviceMesh.from_group(group, "cuda" if dist.get_backend(group) == "nccl" else "cpu")
    fn = build_attention(options or ContextOptions(), group)
    if spec.prepare is not None:
        spec.prepare(module)
    patched = [
        (name, child)
        for name, child in module.named_modules()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.attention)
    ]
    if not patched:
        raise ValueError(
            f"context_parallel_spec() names attention modules {list(spec.attention)} but none exists in "
            f"{type(module).__name__}; fix the patterns (module names relative to it)."
        )
    for name, child in patched:
        if not hasattr(child, spec.attention_attr):
            raise ValueError(
                f"{name} matches the context-parallel spec but has no attribute {spec.attention_attr!r}; fix "
                "context_parallel_spec() of the module."
            )
    if isinstance(fn, TorchRingAttention):  # torch's CP dispatcher on while the attention is in place
        apply_change(patched[0][1], _ring_dispatcher(fn))
    for _, child in patched:
        apply_change(child, _set_attribute(spec.attention_attr, fn))
    cp_group = group.get_group()
    if spec.positions is not None and spec.position_tables:
        apply_change(module.get_submodule(spec.positions), _GlobalPositions(cp_group, spec.position_tables).attach)
    if spec.position_ids is not None:
        apply_change(module.get_submodule(spec.position_ids), _GlobalPositionIds(cp_group).attach)
    split = f"context parallel cp={group.size()}: head-tail sequence split"
    return f"{split}; {len(patched)} attention modules: {fn.description}"


#: A change to a module: called with the module, it makes the change and returns its undo (called with the module).
Change = Callable[[nn.Module], Callable[[nn.Module], None]]


@dataclass
class _Applied:
    order: int  # undone newest first, applied again oldest first
    change: Change
    undo: Callable[[nn.Module], None] | None  # None while undone


# Keyed by the changed module, weakly: the records (whose callables never hold their module) go with it.
_CHANGES: weakref.WeakKeyDictionary[nn.Module, list[_Applied]] = weakref.WeakKeyDictionary()
_ORDER = itertools.count()


def apply_change(module: nn.Module, change: Change) -> None:
    """Make ``change`` to ``module`` and record it for :func:`undo_context_parallel` (a spec's ``prepare`` records its
    own changes so)."""
    _CHANGES.setdefault(module, []).append(_Applied(next(_ORDER), change, change(module)))


def undo_context_parallel(module: nn.Module) -> UndoneChanges:
    """Undo, newest first, what context parallelism changed in ``module`` and its submodules (attention functions,
    position hooks, a spec's ``prepare``): it computes as it did before. Returns those changes, to make them again."""
    records = sorted(_records(module, applied=True), key=lambda record: -record[1].order)
    for owner, record in records:
        record.undo(owner)  # type: ignore[misc]  # applied: it has its undo
        record.undo = None
    return UndoneChanges(records[::-1])


@dataclass
class UndoneChanges:
    """The changes one :func:`undo_context_parallel` undid (oldest first); :meth:`redo` makes exactly these again,
    not those another owner of the module (a later strategy) applied and undid."""

    records: list[tuple[nn.Module, _Applied]]

    def __len__(self) -> int:
        return len(self.records)

    def redo(self) -> int:
        """Make the changes again, oldest first (once: a second call does nothing); returns how many."""
        records, self.records = self.records, []
        for owner, record in records:
            record.undo = record.change(owner)
        return len(records)


def _records(module: nn.Module, applied: bool) -> list[tuple[nn.Module, _Applied]]:
    return [(m, r) for m in module.modules() for r in _CHANGES.get(m, ()) if (r.undo is not None) == applied]


def _ring_dispatcher(fn: TorchRingAttention) -> Change:
    """The change that turns torch's CP dispatcher on for ``fn`` (undone: off, when no other user is left)."""

    def change(module: nn.Module) -> Callable[[nn.Module], None]:
        fn.enable()
        return lambda _: fn.disable()

    return change


def _set_attribute(name: str, value: Any) -> Change:
    """The change that sets attribute ``name`` to ``value`` (undone: the old value, or no attribute again)."""

    def change(module: nn.Module) -> Callable[[nn.Module], None]:
        had, old = name in vars(module), getattr(module, name, None)
        setattr(module, name, value)

        def undo(module: nn.Module) -> None:
            if had:
                setattr(module, name, old)
            else:
                delattr(module, name)

        return undo

    return change


class _GlobalPositions:
    """Forward hooks that give a module's per-position tables this rank's rows for the length of the call, then put
    the whole tables back (a model re-initialized later, e.g. from the meta device, keeps its own tables)."""

    def __init__(self, group: dist.ProcessGroup, tables: tuple[str, ...]) -> None:
        self.cp, self.rank, self.tables = dist.get_world_size(group), dist.get_rank(group), tables
        self._saved: list[tuple[Tensor, ...]] = []

    def attach(self, module: nn.Module) -> Callable[[nn.Module], None]:
        """Register the hooks on ``module``; returns their removal (a :data:`Change`)."""
        handles = (
            module.register_forward_pre_hook(self._before),
            module.register_forward_hook(self._after, always_call=True),  # put the tables back after an error too
        )

        def remove(_: nn.Module) -> None:
            for handle in handles:
                handle.remove()

        return remove

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        local_len = args[0].shape[1]
        whole = tuple(getattr(module, name) for name in self.tables)
        if whole[0].shape[0] < local_len * self.cp:
            raise ValueError(
                f"sequence length {local_len * self.cp} (cp={self.cp} x {local_len}) exceeds the model's "
                f"{whole[0].shape[0]} positions; raise model.max_seq_len."
            )
        positions = head_tail_positions(local_len * self.cp, self.cp, self.rank, whole[0].device)
        self._saved.append(whole)
        for name, table in zip(self.tables, whole):
            setattr(module, name, table.index_select(0, positions))  # row i: the table at global position p(i)

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for name, table in zip(self.tables, self._saved.pop()):
            setattr(module, name, table)


class _GlobalPositionIds:
    """A forward pre-hook that passes ``position_ids=`` this rank's global positions (1, T_local) to a call that
    passes none (a HuggingFace model would use ``arange(T_local)``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def attach(self, module: nn.Module) -> Callable[[nn.Module], None]:
        """Register the hook on ``module``; returns its removal (a :data:`Change`)."""
        handle = module.register_forward_pre_hook(self._before, with_kwargs=True)
        return lambda _: handle.remove()

    def _before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if kwargs.get("position_ids") is not None:
            return None  # the caller's (e.g. a batch's own, split with the sequence)
        local_len = sequence_length((args, kwargs))
        if local_len is None:
            raise ValueError(
                f"{type(module).__name__} was called with no (B, T) tensor, so cp={self.cp} cannot give it positions; "
                "pass its inputs (input_ids or inputs_embeds) or position_ids."
            )
        device = next((t.device for t in _tensors((args, kwargs))), None)
        positions = head_tail_positions(local_len * self.cp, self.cp, self.rank, device)
        return args, {**kwargs, "position_ids": positions.unsqueeze(0)}
