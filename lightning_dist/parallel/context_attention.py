"""Attention across the cp group for a rank holding its head and tail chunks of each sequence (``parallel/context.py``).

Each implementation is a callable ``fn(q, k, v, scale=None) -> out`` with ``q`` (B, H, T_local, D), ``k`` / ``v``
(B, K, T_local, D) (K dividing H: grouped-query attention), causal over the global positions; chosen by name with
``parallelism.context.attention`` (:meth:`~lightning_dist.parallel.options.ContextOptions.resolve`):

- ``"allgather"`` (:class:`AllGatherAttention`): all-gather keys and values over the cp group (their gradients are
  reduce-scattered back to their owners), then attend with this rank's two query chunks, each against the keys up
  to its own end under the causal mask of its global positions. Any backend and device, exact (gloo on CPU
  included). Memory: the whole sequence's keys and values on every rank, per layer (freed after it).
- ``"torch"`` (:class:`TorchRingAttention`): torch's own context parallelism (2.13:
  ``torch.distributed.tensor.experimental._context_parallel``). SDPA on DTensors sharded on the sequence dim runs
  torch's ring: each rank attends its queries to one cp rank's keys and values at a time and merges the partial
  results by their log-sum-exp, while the next keys and values arrive (``cp_rotate``: one ``allgather`` up front, or
  ``alltoall`` ring steps; the backward gathers them again so, and always passes their gradients by ``alltoall``
  ring steps). Only CUDA's flash, efficient and cuDNN kernels are routed to it (``_sdpa_handler``);
  CPU's SDPA on such DTensors has no sharding rule at all. Its causal schedule with load balancing assumes that
  rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, in that order (``_HeadTailLoadBalancer``), which
  is exactly our split: the shards go in as they are. Partial results are merged in fp32.
- ``"auto"``: ``torch`` on CUDA (falling back to ``allgather`` for a call whose shapes or dtype no such kernel
  takes), else ``allgather``.

torch's ring is checked before it is trusted: the first call of each input kind (shapes, dtype, strides) also runs
the exact all-gather attention and compares the two forwards (their largest difference over the cp group, relative
to the output's scale; one host read per kind). A ring that disagrees is not used: ``auto`` falls back to the
all-gather attention with one warning, ``torch`` stops with one line.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.backends import cuda
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from lightning_dist import _compat
from lightning_dist._compat import all_gather_single, reduce_scatter_sum_single
from lightning_dist.parallel.options import ContextOptions
from lightning_dist.parallel_dims import check_context_parallel_seq_len


def head_tail_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """Global positions of cp rank ``rank``'s tokens, in its local order: chunk ``rank``, then chunk
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks. Shape (seq_len // cp,), int64."""
    check_context_parallel_seq_len(cp, seq_len, "the sequence length")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat((head, tail))


def build_attention(options: ContextOptions, mesh: DeviceMesh) -> AllGatherAttention | TorchRingAttention:
    """The cp attention ``options.attention`` (``auto``, ``allgather`` or ``torch``) resolves to on ``mesh``'s device
    type.

    Raises:
        ValueError: ``torch`` off CUDA, or ``rotate=alltoall`` where the all-gather attention runs (one line each).
    """
    attention, rotate = options.attention, options.rotate
    name = options.resolve(mesh.device_type)
    if name == "torch":
        fallback = AllGatherAttention(mesh.get_group()) if attention == "auto" else None
        return TorchRingAttention(mesh, rotate, fallback)
    fn = AllGatherAttention(mesh.get_group())
    if attention == "auto":
        fn.description += (
            f" (context.attention=auto on {mesh.device_type}: torch's ring attention has CUDA kernels only)"
        )
    return fn


# ------------------------------------------------------------------------------------------------ all-gather
class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums the gradient of every copy into its owner (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        reduce_scatter_sum_single(out, grad.contiguous(), ctx.group)
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

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.description = (
            "all-gather of K/V over cp, then causal attention per head/tail chunk (portable, any backend)"
        )
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


# ------------------------------------------------------------------------------------------- torch's ring
#: Largest relative difference from the exact attention a ring kernel's forward may have, by dtype (rounding of the
#: inputs and of the kernels' accumulation; a wrong causal offset or chunk order is off by O(1)).
_AGREE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: The SDPA kernels torch's ring attention handles (torch 2.13 ``_sdpa_handler``): never the math fallback.
_RING_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_ring_users = 0  # TorchRingAttention uses enabled in this process: torch's CP dispatcher is on while > 0


def _ring_kernel_runs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    params = cuda.SDPAParams(q, k, v, None, 0.0, True, k.shape[1] != q.shape[1])
    return any(
        can(params)
        for can in (cuda.can_use_flash_attention, cuda.can_use_efficient_attention, cuda.can_use_cudnn_attention)
    )


class TorchRingAttention:
    """torch's ring attention for a cp rank holding its head and tail chunks (CUDA only; see the module docstring).

    torch's CP dispatcher is process-wide: :meth:`enable` and :meth:`disable` count its users, the first turns it on
    and the last off (DTensor SDPA behaves as without context parallelism again).

    Args:
        mesh: The 1-D cp mesh (CUDA).
        rotate: How keys and values reach the other ranks: ``allgather`` or ``alltoall`` (``set_rotate_method``).
        fallback: Called instead for q / k / v that no ring kernel takes (shapes, dtype, GPU); ``None``: raise.
    """

    name = "torch"

    def __init__(
        self, mesh: DeviceMesh, rotate: str = "allgather", fallback: Callable[..., Tensor] | None = None
    ) -> None:
        self.mesh, self.rotate, self.fallback = mesh, rotate, fallback
        self._repeat: dict[tuple[Any, ...], bool | None] = {}  # per input kind: repeat K/V heads? None: no ring kernel
        self.description = (
            f"torch's ring attention (CUDA flash / efficient / cuDNN SDPA on DTensors sharded over cp, head-tail "
            f"load balance, K/V rotate={rotate})"
            + ("; all-gather where no such kernel takes a call" if fallback else "")
        )

    @functools.cached_property
    def reference(self) -> AllGatherAttention:
        """The exact attention the ring's first call of each input kind must equal."""
        return AllGatherAttention(self.mesh.get_group())

    def enable(self) -> None:
        """Turn torch's CP dispatcher on (first user) with this attention's rotate method."""
        global _ring_users
        if _ring_users == 0:
            _compat.torch_ring_attention(True, self.rotate)
        _ring_users += 1

    def disable(self) -> None:
        """Give up this use; the last one turns torch's CP dispatcher off."""
        global _ring_users
        _ring_users -= 1
        if _ring_users == 0:
            _compat.torch_ring_attention(False)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        """``q`` (B, H, T_local, D), ``k`` / ``v`` (B, K, T_local, D) of this rank's tokens -> (B, H, T_local, D)."""
        repeat = self._kernel_inputs(q, k, v, scale)
        if repeat is None:
            if self.fallback is None:
                raise ValueError(
                    "context.attention=torch: no CUDA SDPA kernel of torch's ring attention (flash / efficient / "
                    f"cuDNN) takes q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} here; set "
                    "parallelism.context.attention=allgather (or auto)."
                )
            return self.fallback(q, k, v, scale=scale)
        return self._ring(q, k, v, scale, repeat)

    def _ring(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, repeat: bool) -> Tensor:
        if repeat:  # a kernel without grouped-query support: K/V with H heads (their gradients summed back to K)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        placement = [Shard(2)]
        q, k, v = (DTensor.from_local(t, self.mesh, placement, run_check=False) for t in (q, k, v))
        with sdpa_kernel(_RING_KERNELS):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        return out.to_local()

    def _kernel_support(self, q: Tensor, k: Tensor, v: Tensor) -> bool | None:
        """Whether K/V must be repeated to H heads for a ring kernel (flash takes K heads), ``None`` if none runs."""
        groups = q.shape[1] // k.shape[1]
        if q.device.type != "cuda":
            return None
        if _ring_kernel_runs(q, k, v):
            return False
        if groups > 1 and _ring_kernel_runs(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)):
            return True
        return None

    def _kernel_inputs(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> bool | None:
        """:meth:`_kernel_support` for this input kind, once the ring's forward agreed with the exact attention."""
        key = (q.shape, k.shape, q.dtype, q.device, q.stride(-1), k.stride(-1), v.stride(-1), q.requires_grad)
        if key in self._repeat:
            return self._repeat[key]
        repeat = self._kernel_support(q, k, v)
        why = f"no CUDA SDPA kernel of torch's ring attention takes q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype}"
        # On torch's fake backend (a rehearsed rank, run/rehearse.py) no value is real: nothing to compare.
        if repeat is not None and dist.get_backend(self.mesh.get_group()) != "fake":
            error = self._difference(q, k, v, scale, repeat)
            if error > _AGREE.get(q.dtype, 1e-4):
                repeat = None
                why = (
                    f"torch's ring attention differs from the exact attention by {error:.3g} (relative) on q "
                    f"{tuple(q.shape)} {q.dtype}"
                )
                if self.fallback is None:
                    raise ValueError(f"context.attention=torch: {why}; set parallelism.context.attention=allgather.")
        if repeat is None and self.fallback is not None:
            warnings.warn(
                f"context.attention=auto: {why}; the all-gather attention runs for these calls.", stacklevel=3
            )
        self._repeat[key] = repeat
        return repeat

    def _difference(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, repeat: bool) -> float:
        """The ring's forward against the all-gather attention's: largest difference over the cp group / largest
        output (a host read, once per input kind)."""
        with torch.no_grad():
            q, k, v = q.detach(), k.detach(), v.detach()
            got, want = self._ring(q, k, v, scale, repeat).float(), self.reference(q, k, v, scale=scale).float()
            stats = torch.stack(((got - want).abs().max(), want.abs().max())).reshape(2)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
        return float(stats[0] / stats[1].clamp_min(1e-6))
