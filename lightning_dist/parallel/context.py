"""Context parallelism: each sequence split over the ``cp`` ranks, attention computed across them.

No Lightning, no model code. A model takes part through a :class:`ContextParallelSpec` (which of its modules hold
an attention function, which of its buffers are per-position tables, or which module takes ``position_ids``);
:func:`apply_context_parallel` replaces those functions and re-indexes those tables (or passes this rank's global
positions), and the strategy splits each batch with :func:`shard_batch`.

Load balancing (head-tail): the sequence is cut into ``2 x cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so under a causal mask every rank attends over the same number of (query, key) pairs.

Attention implementations (:data:`ATTENTION`), chosen by name:

- ``"allgather"`` (:class:`AllGatherAttention`): all-gather keys and values over the cp group (their gradients are
  reduce-scattered back to their owners), then attend with this rank's two query chunks, each against the keys up
  to its own end under the causal mask of its global positions. Any backend and device, exact (gloo on CPU
  included). Memory: the whole sequence's keys and values on every rank, per layer (freed after it).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.bias import causal_lower_right

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
def head_tail_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """Global positions of cp rank ``rank``'s tokens, in its local order: chunk ``rank``, then chunk
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks. Shape (seq_len // cp,), int64."""
    check_context_parallel_seq_len(cp, seq_len, "the sequence length")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat((head, tail))


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


# --------------------------------------------------------------------------------------------------- attention
# torch 2.13's names; older releases have only the ones they deprecate (same arguments). Looked up at each call, not
# bound once: the telemetry's CommTracker counts cp traffic by replacing torch.distributed's functions while installed.
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums the gradient of every copy into its owner (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def _causal_chunk(query: Tensor, keys: Tensor, values: Tensor, scale: float | None) -> Tensor:
    """Query ``i`` of ``query`` (B, H, c, D) against ``keys`` / ``values`` (B, K, end, D) up to ``i + end - c``
    (the lower-right causal mask), with no quadratic tensor kept for the backward."""
    chunk, end = query.shape[2], keys.shape[2]
    if query.device.type != "cpu":  # CUDA's flash / efficient kernels take the lower-right mask as a flag
        mask = causal_lower_right(chunk, end)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    # On CPU torch materializes a CausalBias (an additive c x end mask, kept for the backward): instead, zero queries
    # in front make the mask the square causal one, which the CPU flash kernel takes as a flag. Costs (end - c)
    # query rows of compute and two (B, H, end, D) tensors kept, linear in T; their outputs are dropped.
    padded = torch.cat((query.new_zeros(*query.shape[:2], end - chunk, query.shape[3]), query), dim=2)
    out = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return out[:, :, end - chunk :]


class AllGatherAttention:
    """Causal attention over the whole sequence for a cp rank holding its head and tail chunks (portable, exact).

    Args:
        group: The cp process group.
    """

    name = "allgather"
    description = "all-gather of K/V over cp, then causal attention per head/tail chunk (portable, any backend)"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._order_cache: Tensor | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        """``q`` (B, H, T_local, D), ``k`` / ``v`` (B, K, T_local, D) of this rank's tokens -> (B, H, T_local, D);
        ``scale`` multiplies the scores (``None``: ``D ** -0.5``)."""
        cp, local_len = self.cp, q.shape[2]
        chunk = local_len // 2
        # One collective for keys and values; gathered before the grouped-query repeat (K heads, not H, travel).
        kv = _AllGather.apply(torch.stack((k, v)), self.group)  # (cp * 2, B, K, T_local, D), rank-major
        kv = kv.unflatten(0, (cp, 2)).movedim(0, 3).flatten(3, 4)  # (2, B, K, cp * T_local, D)
        kv = kv.index_select(3, self._order(cp * local_len, kv.device))  # (2, B, K, T, D): global order
        keys, values = kv[0], kv[1]  # K heads: SDPA's grouped-query path keeps these, not H repeated copies
        outs = []
        for index, chunk_id in enumerate((self.rank, 2 * cp - 1 - self.rank)):
            start = chunk_id * chunk  # global position of the chunk's first query
            end = start + chunk  # keys after the chunk's last query are masked for all of it: not computed
            query = q[:, :, index * chunk : (index + 1) * chunk]  # (B, H, c, D)
            outs.append(_causal_chunk(query, keys[:, :, :end], values[:, :, :end], scale))
        return torch.cat(outs, dim=2)  # (B, H, T_local, D)

    def _order(self, seq_len: int, device: torch.device) -> Tensor:
        """For each global position, its index in the rank-major concatenation of every rank's tokens."""
        if self._order_cache is None or self._order_cache.shape[0] != seq_len or self._order_cache.device != device:
            held = torch.cat([head_tail_positions(seq_len, self.cp, r, device) for r in range(self.cp)])
            self._order_cache = torch.argsort(held)
        return self._order_cache


#: Attention implementations by name: ``fn(cp_group) -> attention function`` (``(q, k, v, scale=None) -> out``).
ATTENTION: dict[str, Callable[[dist.ProcessGroup], Callable[..., Tensor]]] = {
    AllGatherAttention.name: AllGatherAttention,
}


# ----------------------------------------------------------------------------------------------- applying it
def apply_context_parallel(
    module: nn.Module, spec: ContextParallelSpec, group: dist.ProcessGroup, attention: str = "allgather"
) -> str:
    """Make ``module`` compute on this cp rank's part of each sequence: replace its attention functions and index its
    position tables by this rank's global positions. In place; the batch is split by the caller (:func:`shard_batch`).

    Args:
        module: The module to change; ``spec``'s names are relative to it.
        spec: Which modules and buffers take part.
        group: The cp process group.
        attention: A key of :data:`ATTENTION`.

    Returns:
        What runs, in words (for ``describe()``).

    Raises:
        ValueError: An unknown ``attention``, or a pattern that matches no module (one line each).
    """
    if attention not in ATTENTION:
        raise ValueError(f"cp attention={attention!r} is unknown; use one of {sorted(ATTENTION)}.")
    fn = ATTENTION[attention](group)
    if spec.prepare is not None:
        spec.prepare(module)
    patched = 0
    for name, child in module.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.attention):
            if not hasattr(child, spec.attention_attr):
                raise ValueError(
                    f"{name} matches the context-parallel spec but has no attribute {spec.attention_attr!r}; fix "
                    "context_parallel_spec() of the module."
                )
            setattr(child, spec.attention_attr, fn)
            patched += 1
    if patched == 0:
        raise ValueError(
            f"context_parallel_spec() names attention modules {list(spec.attention)} but none exists in "
            f"{type(module).__name__}; fix the patterns (module names relative to it)."
        )
    if spec.positions is not None and spec.position_tables:
        _GlobalPositions(group, spec.position_tables).attach(module.get_submodule(spec.positions))
    if spec.position_ids is not None:
        _GlobalPositionIds(group).attach(module.get_submodule(spec.position_ids))
    size = dist.get_world_size(group)
    return f"context parallel cp={size}: head-tail sequence split; {patched} attention modules: {fn.description}"


class _GlobalPositions:
    """Forward hooks that give a module's per-position tables this rank's rows for the length of the call, then put
    the whole tables back (a model re-initialized later, e.g. from the meta device, keeps its own tables)."""

    def __init__(self, group: dist.ProcessGroup, tables: tuple[str, ...]) -> None:
        self.cp, self.rank, self.tables = dist.get_world_size(group), dist.get_rank(group), tables
        self._saved: list[tuple[Tensor, ...]] = []

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after, always_call=True)  # put the tables back after an error too

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

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._before, with_kwargs=True)

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
