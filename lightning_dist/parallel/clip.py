"""Gradient norm and clipping over every axis at once (dp shards, tp shards, pipeline stages)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def global_grad_norm(parameters: Iterable[torch.nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank.

    DTensor gradients (TP and FSDP2 shards) are reduced by DTensor itself; plain tensors are replicated, so their
    local norm is already global. A pipeline stage holds only its own layers, so squared norms are summed over
    ``pp_group``.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[Tensor]] = {}
    plain: list[Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            by_mesh.setdefault(grad.device_mesh, []).append(grad)
        else:
            plain.append(grad)
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        squares = squares + norm.full_tensor().float().square()
    if plain:
        squares = squares + torch.nn.utils.get_total_norm(plain, norm_type=2.0, foreach=True).float().square()
    if pp_group is not None:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_group)
    return squares.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    norm_exclude: Collection[int] = frozenset(),
) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (``None``: only measure). Returns the norm.

    ``norm_exclude``: ids of parameters left out of the norm (but clipped): the copies of a weight tied across
    pipeline stages beyond the first, which would otherwise be counted once per stage.
    """
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm([p for p in parameters if id(p) not in norm_exclude], pp_group)
    if max_norm is not None and parameters:
        by_mesh: dict[object, list[torch.nn.Parameter]] = {}
        for p in parameters:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.dtype), foreach=True)
    return norm
