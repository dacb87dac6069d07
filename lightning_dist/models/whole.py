"""Setting a parameter from its whole value, whatever part of it this rank holds.

Every model here initializes each tensor as one process would (drawn whole on the CPU, seeded by name), then keeps
this rank's part. A DTensor's own ``copy_`` of a whole tensor does that for shards of equal size but refuses an uneven
one (a router gate of 8 experts FSDP2-sharded over 64 ranks, Qwen2-MoE's one-row gate over 2), so the slice is cut
here by the tensor's placements, with no collective: every rank computed the same whole value.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def copy_whole(into: Tensor, value: Tensor) -> None:
    """Copy into ``into`` (a plain tensor, or a DTensor of which this rank holds a part) its part of ``value``, the
    whole tensor's value (on any device; cast to ``into``'s dtype)."""
    if isinstance(into, DTensor):
        local = distribute_tensor(value.to(into.dtype), into.device_mesh, into.placements, src_data_rank=None)
        into.to_local().copy_(local.to_local())
    else:
        into.copy_(value.to(device=into.device, dtype=into.dtype))
