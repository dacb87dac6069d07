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
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard


def apply_fsdp(
    units: Iterable[nn.Module],
    roots: Iterable[nn.Module | list[nn.Module]],
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    reduce_dtype: torch.dtype | None = None,
    shard_dim: int = 0,
    ignored_params: Iterable[nn.Parameter] = (),
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
        reshard_after_forward: Free gathered parameters after forward (except the last unit's and root's). Pipeline
            parallelism passes ``False`` so microbatches do not all-gather the same parameters again.
        reduce_dtype: The dtype gradients are reduced in; ``None`` = float32 under ``param_dtype``, else the
            parameters' own.
        cpu_offload: Keep the sharded parameters, their gradients and so the optimizer state in host memory; FSDP2
            copies a unit to the device for its all-gather (pinned memory where CUDA is available).
        shard_dim: The dim each parameter is sharded on (FSDP2's ``shard_placement_fn``): 0, or 1 for stacked experts
            fewer than the ranks sharding them (dim 0 would leave ranks without any).
        ignored_params: Parameters FSDP2 leaves alone: every rank holds them whole, as they are (a frozen QLoRA base,
            quantized later from each whole weight); they get no gradient, so nothing of theirs is reduced.
    """
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32  # low-precision compute, full-precision gradient sums
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options: dict = {"mesh": dp_mesh, "mp_policy": mp_policy, "offload_policy": offload}
    if shard_dim:
        options["shard_placement_fn"] = lambda param: Shard(shard_dim)
    if ignored := set(ignored_params):
        options["ignored_params"] = ignored
    units = list(units)
    for index, unit in enumerate(units):
        # The last block is the first one backward needs: resharding it after forward would only all-gather it
        # again at once (torchtitan's default too). Memory stays the same at the peak, where both hold it.
        last = index == len(units) - 1
        fully_shard(unit, reshard_after_forward=reshard_after_forward and not last, **options)
    roots = list(roots)
    for index, root in enumerate(roots):
        # The last root (the one holding the head) too: its backward comes first, and a loss that applies the head
        # after the model's forward (models/loss.py: chunked_token_loss) needs it gathered then.
        last = index == len(roots) - 1
        fully_shard(root, reshard_after_forward=reshard_after_forward and not last, **options)


def param_dtype_of(precision: str) -> torch.dtype | None:
    """FSDP2's parameter dtype for Lightning's precision string: bf16 / fp16 for ``*-mixed``, else ``None`` (keep
    the parameter dtype)."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of a model that declares none: the children of the module list (``nn.ModuleList`` /
    ``nn.Sequential`` / ``nn.ModuleDict``) with the most children, at least two, all of one class and holding
    parameters (a transformer's layers); ``[]`` when no list looks so. What FSDP2 wraps one by one, and what
    activation checkpointing and compile take, for a module without ``pipeline_spec()``."""
    best: list[nn.Module] = []
    for container in module.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = list(container.children())
        same = len({type(child) for child in children}) == 1
        if same and len(children) >= 2 and len(children) > len(best) and any(True for _ in children[0].parameters()):
            best = children
    return best
