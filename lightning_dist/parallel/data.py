"""Data parallelism with FSDP2 (``fully_shard``): sharding over ``dp_shard``, replication over ``dp_replicate``.

One mechanism covers the three data-parallel layouts: a 1-D ``dp_shard`` mesh is FSDP, a 2-D
``(dp_replicate, dp_shard)`` mesh is HSDP, and ``dp_shard=1`` on that 2-D mesh is pure replication (DDP
semantics: full parameters on every rank, gradients all-reduced).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    units: Iterable[nn.Module],
    roots: Iterable[nn.Module | list[nn.Module]],
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Wrap each of ``units`` (transformer blocks), then each of ``roots`` (what owns the rest), with FSDP2.

    Blocks are wrapped one by one so that only one block's full parameters are alive at a time, and their
    all-gathers overlap the previous block's compute. Roots come last so they pick up the remaining parameters
    (embedding, final norm, head).

    Args:
        units: Modules sharded as their own FSDP unit, in execution order.
        roots: Modules called by the training step that hold the remaining parameters; a list of modules is one
            unit (modules sharing a parameter must be, or FSDP2 makes two parameters of it).
        dp_mesh: 1-D ``dp_shard`` mesh, or 2-D ``(dp_replicate, dp_shard)`` mesh for HSDP / replication.
        param_dtype: Compute dtype of the gathered parameters (bf16 for mixed precision); gradients are
            reduced in float32.
        reshard_after_forward: Free gathered parameters after forward. Pipeline parallelism passes ``False`` so
            microbatches do not all-gather the same parameters again.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
