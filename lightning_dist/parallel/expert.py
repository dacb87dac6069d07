"""Expert parallelism: an MoE block's experts split over the ``ep`` ranks, tokens sent to them and back by all-to-all.

Model-agnostic: it takes any experts module with the interface transformers' MoE families and the built-in GPT share,
``experts(hidden (N, C), top_k_index (N, K), top_k_weights (N, K)) -> (N, C)`` (each token's weighted sum of its
experts' outputs), whose parameters stack the experts on dim 0 and whose integer attribute ``num_experts`` (when it
has one) says how many it holds. :func:`apply_expert_parallel` makes each such module's parameters DTensors on the
experts' axes and wraps its forward:

- ``ep > 1``: each rank keeps ``num_experts / ep`` consecutive experts (``Shard(0)`` on ``ep``). Its routed rows
  (each token once per chosen expert) are sorted by expert, the row counts exchanged by one all-to-all (one read back
  to the host per MoE block and forward: the dropless all-to-all needs its split sizes), the rows sent to the ranks
  holding their experts by a second (``torch.distributed.nn.functional.all_to_all_single``: its backward is the
  reverse all-to-all), computed there by the module's own forward, sent back, weighted and summed per token.
- ``tp > 1``: the experts stay whole on every tp rank (``Replicate`` on ``tp``) and each tp rank runs them on its
  ``1 / tp`` of the tokens (which the tp ranks all hold), the outputs all-gathered; the experts' gradients are then
  partial sums over ``tp`` (reduced by FSDP2 or :func:`~lightning_dist.parallel.tensor.reduce_partial_grads`).

Inside the wrapped forward the module sees plain tensors: its DTensor parameters are read as this rank's local ones
(autograd flows back into the DTensors) and ``num_experts`` is the local count. The data-parallel side (FSDP2 over
the ranks that hold the same experts, the gradient divided by all data-parallel ranks) is
:func:`apply_expert_fsdp`, step 4 of :func:`lightning_dist.parallel.compose.parallelize`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_dist.parallel.data import apply_fsdp
from lightning_dist.parallel.options import check_expert_parallel
from lightning_dist.parallel_dims import EP, ParallelDims


@dataclass(frozen=True)
class ExpertParallelSpec:
    """Where a module's experts are: what :func:`apply_expert_parallel` needs (the module's
    ``expert_parallel_spec()``; see :class:`lightning_dist.contract.ParallelModule`).

    Attributes:
        experts: Module-name patterns (``fnmatch``, relative to the module parallelized) of the experts modules.
        num_experts: Experts per MoE block (``ep`` must divide it).
        load: The routers' token counts of the step so far (one tensor per MoE block this rank holds, updated in
            place), which the strategy sums over the data-parallel ranks after the step's last backward, before the
            module's ``on_before_optimizer_step`` reads them (load balancing); ``None``: the module keeps none.
    """

    experts: tuple[str, ...]
    num_experts: int
    load: Callable[[], Iterable[Tensor]] | None = None

    def relative_to(self, prefix: str) -> ExpertParallelSpec:
        """This spec with ``prefix`` taken off its patterns (a pipeline stage holds the model under its own name)."""
        return replace(self, experts=tuple(pattern.removeprefix(prefix) for pattern in self.experts))

    @contextmanager
    def load_kept(self) -> Iterator[None]:
        """Put the token counts back as they were on leaving (torch's pipeline stages infer their shapes by running
        the model, which must not count as routing)."""
        kept = [(tensor, tensor.clone()) for tensor in (self.load() if self.load is not None else ())]
        try:
            yield
        finally:
            for tensor, value in kept:
                tensor.copy_(value)

    def modules(self, module: nn.Module) -> dict[str, nn.Module]:
        """The experts modules of ``module`` (a pipeline stage: those it holds), by name."""
        return {
            name: child
            for name, child in module.named_modules()
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.experts)
        }


def apply_expert_parallel(module: nn.Module, spec: ExpertParallelSpec, dims: ParallelDims) -> str:
    """Lay out the experts of ``module`` over ``dims.expert_mesh_axes`` and wrap their forwards (see the module
    docstring); nothing when ``ep = tp = 1``.

    Returns:
        What runs, in words (for the start-up layout); empty when nothing was applied.

    Raises:
        ValueError: ``ep`` does not divide the number of experts, or an experts parameter is not one row per expert.
    """
    axes = dims.expert_mesh_axes
    if not axes:
        return ""
    check_expert_parallel(spec.num_experts, dims.ep)
    found = spec.modules(module)
    if not found:
        return ""  # a pipeline stage of dense blocks only (contract.declared_ep_spec checked the whole model)
    mesh = dims.mesh[axes if len(axes) > 1 else axes[0]]
    placements = [Shard(0) if axis == EP else Replicate() for axis in axes]
    for experts in found.values():
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                raise ValueError(f"the experts' parameter {name} is a DTensor already; leave it to expert parallelism.")
            if param.shape[0] != spec.num_experts:
                raise ValueError(
                    f"the experts' parameter {name} has {param.shape[0]} rows on dim 0, not one per expert "
                    f"({spec.num_experts}); expert parallelism needs the experts stacked on dim 0."
                )
            shard = nn.Parameter(distribute_tensor(param.data, mesh, placements), param.requires_grad)
            experts.register_parameter(name, shard)
        ExpertDispatch(experts, dims, spec.num_experts).install()
    parts = []
    if dims.ep > 1:
        parts.append(f"experts split over ep={dims.ep} ({spec.num_experts // dims.ep} per rank), all-to-all dispatch")
    if dims.tp > 1:
        parts.append(f"tokens split over tp={dims.tp} (experts whole on each tp rank)")
    return f"expert parallel: {len(found)} MoE blocks; " + "; ".join(parts)


class ExpertDispatch:
    """The wrapped forward of one experts module (see the module docstring)."""

    #: Take a balanced routing's split sizes (every ep rank sends each the same rows) instead of reading the counts
    #: back to the host: set by the planner's trace (``plan/trace.py``), whose fake tensors hold no values.
    balanced_splits: bool = False

    def __init__(self, experts: nn.Module, dims: ParallelDims, num_experts: int) -> None:
        self.experts = experts
        self.num_experts = num_experts
        self.ep = dims.ep
        self.ep_group = dims.group(EP) if dims.ep > 1 else None
        self.tp_mesh: DeviceMesh | None = dims.mesh["tp"] if dims.tp > 1 else None
        self.forward = experts.forward  # the module's own (bound) forward, run on this rank's tokens and experts

    def install(self) -> None:
        """Make this the module's forward (an instance attribute: the class and other instances stay as they are)."""
        self.experts.forward = self  # type: ignore[method-assign]

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tp, rows = self.tp_mesh, hidden_states.shape[0]
        if tp is not None:  # this tp rank's part of the tokens, which every tp rank holds
            hidden_states, top_k_weights = (_split_rows(t, tp) for t in (hidden_states, top_k_weights))
            top_k_index = _split_rows(top_k_index, tp)
        with self._local():
            if self.ep_group is None:
                out = self.forward(hidden_states, top_k_index, top_k_weights)
            else:
                out = self._dispatch_and_combine(hidden_states, top_k_index, top_k_weights)
        return _gather_rows(out, tp, rows) if tp is not None else out

    @contextmanager
    def _local(self) -> Iterator[None]:
        """The module's DTensor parameters read as this rank's local tensors (and ``num_experts`` as the local count)
        while its forward runs; autograd carries their gradients back into the DTensors.

        Under ``ep > 1`` an expert's gradient sums the tokens of every rank of its ep group, and FSDP2 averages it over
        the ranks holding the same experts (``1 / ep`` of the data-parallel ones): it is divided by ``ep`` on the way,
        so the experts' gradients are means over every data-parallel rank, as the dense ones are.
        (``FSDPModule.set_gradient_divide_factor`` would do it in the reduce-scatter, but NCCL's PREMUL_SUM has no
        gloo counterpart, and with a sum forced instead torch 2.13 divides twice where the FSDP2 group is one rank.)"""
        module, shadowed = self.experts, []
        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, DTensor):
                # An instance attribute is found before nn.Module's __getattr__ looks in _parameters.
                local = param.to_local(grad_placements=_grad_placements(param))
                module.__dict__[name] = ScaleGrad.apply(local, 1.0 / self.ep) if self.ep > 1 else local
                shadowed.append(name)
        count = module.__dict__.get("num_experts")
        if isinstance(count, int):
            module.__dict__["num_experts"] = self.num_experts // self.ep
        try:
            yield
        finally:
            for name in shadowed:
                module.__dict__.pop(name, None)
            if isinstance(count, int):
                module.__dict__["num_experts"] = count

    def _dispatch_and_combine(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        ep, group, local = self.ep, self.ep_group, self.num_experts // self.ep
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (R,)
        order = torch.argsort(flat, stable=True)  # (R,): routed rows by expert, so by the rank holding it
        token = order // top_k  # (R,)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,): rows this rank sends to each expert
        received = torch.empty_like(counts)  # (E,) as (ep, local): rows each rank sends to each of my experts
        dist.all_to_all_single(received, counts, group=group)
        if self.balanced_splits:  # a planner's trace on fake tensors: no counts to read
            send = recv = [flat.numel() // ep] * ep
        else:  # the one read back to the host (tests/distributed/test_host_syncs.py counts it here)
            send, recv = torch.stack([counts.view(ep, local).sum(1), received.view(ep, local).sum(1)]).tolist()
        rows = AllToAll.apply(x[token], recv, send, group)  # (R', C): the rows routed to my experts
        # Each source rank's rows arrive sorted by expert: the local expert of each received row.
        expert = torch.arange(local, device=flat.device).repeat(ep)  # (ep * local,)
        ids = expert.repeat_interleave(received, output_size=sum(recv)).unsqueeze(-1)  # (R', 1)
        out = self.forward(rows, ids, torch.ones(ids.shape, dtype=top_k_weights.dtype, device=ids.device))  # (R', C)
        back = AllToAll.apply(out, send, recv, group)  # (R, C): my rows' outputs, in the order they left
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)  # (R, 1)
        back = (back.float() * weights.float()).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, back)  # (N, C)


class ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient multiplied by ``scale`` on its way back."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _grad_placements(param: DTensor) -> list[Any]:
    """The placements of ``param``'s gradient as this rank computes it: a partial sum over ``tp`` (each tp rank ran
    the experts on other tokens), as the parameter's own elsewhere (``Shard(0)`` on ``ep``; FSDP2's axes, on which it
    reduces the gradient itself, after the gather that made the parameter whole here)."""
    names = param.device_mesh.mesh_dim_names or ()
    return [Partial() if name == "tp" else placement for name, placement in zip(names, param.placements)]


class AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` of rows with autograd: the backward sends the gradients back the way the
    rows came (the splits swapped). Plain c10d calls, so the communication telemetry counts both directions."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def _split_rows(tensor: Tensor, mesh: DeviceMesh) -> Tensor:
    """This tp rank's rows of ``tensor``, which every tp rank holds whole (its gradient all-gathered back)."""
    whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(0)]).to_local()


def _gather_rows(tensor: Tensor, mesh: DeviceMesh, rows: int) -> Tensor:
    """Every tp rank's rows (``_split_rows`` undone: ``rows`` in all), the same whole tensor on each."""
    shape = torch.Size((rows, *tensor.shape[1:]))
    stride = (tensor.stride(0), *tensor.stride()[1:]) if tensor.dim() > 1 else (1,)
    part = DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return part.redistribute(mesh, [Replicate()]).to_local()


def apply_expert_fsdp(module: nn.Module, spec: ExpertParallelSpec, dims: ParallelDims, **fsdp_kwargs: Any) -> list[str]:
    """FSDP2 for each experts module of ``module`` (``ep > 1``): sharded over the ranks that hold the same experts
    (:attr:`ParallelDims.expert_fsdp_mesh_axes`), wrapped before the blocks so the blocks' units leave the experts'
    parameters to it. It averages their gradients over its ``1 / ep`` of the data-parallel ranks; the wrapped forward
    divided them by ``ep`` (:meth:`ExpertDispatch._local`).

    Args:
        module: The model (or pipeline stage) whose experts to wrap.
        spec: Where its experts are.
        dims: The layout; its mesh must be built.
        fsdp_kwargs: :func:`~lightning_dist.parallel.data.apply_fsdp`'s precision, offload and resharding options.

    Returns:
        The names of the experts modules wrapped.
    """
    found = spec.modules(module)
    axes = dims.expert_fsdp_mesh_axes
    mesh = dims.mesh[axes if len(axes) > 1 else axes[0]]
    # Fewer local experts than ranks sharding them (Mixtral's 8 over ep2 x efsdp 8): dim 0 would leave most ranks
    # none (FSDP2 pads it), so each expert is sharded along its rows instead, as torchtitan does.
    shard_dim = 1 if mesh.size() > spec.num_experts // dims.ep else 0
    apply_fsdp(found.values(), (), mesh, shard_dim=shard_dim, **fsdp_kwargs)
    return list(found)
