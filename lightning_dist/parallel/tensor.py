"""Tensor parallelism: apply a plan of torch ``ParallelStyle``s to module-name patterns.

A plan maps patterns such as ``"layers.*.attn.q_proj"`` (``fnmatch`` on the full module name) to a
``ParallelStyle`` or one of the names in :data:`STYLE_NAMES` (ours, ``"colwise"``, ``"rowwise"``, ``"sequence"``,
and the names transformers' shipped plans use). Every pattern must match at least one module: a typo in a plan is an
error, not a silently unsharded layer.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TensorParallelPlan = Mapping[str, "ParallelStyle | str"]


class ReplicateShardedInput(ParallelStyle):
    """A module whose parameters stay whole on every tp rank but whose input is this rank's shard (a norm over each
    attention head's width, applied to the heads a column-sharded projection left here: Qwen3's and Gemma3's q / k
    norms; transformers' ``replicated_with_grad_allreduce``).

    The input is marked sharded on ``input_dim`` (any dim the module does not reduce over), so the parameters'
    gradients come out as partial sums and are summed over the tp ranks, as in one process; marked replicated, each
    rank would step its copy with its own heads' gradient alone, and the copies would drift apart.
    """

    def __init__(self, input_dim: int = -2) -> None:
        super().__init__()
        self.input_dim = input_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, [Shard(self.input_dim % x.ndim)], run_check=False)
                if isinstance(x, Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        return distribute_module(module, device_mesh, input_fn=wrap, output_fn=unwrap_outputs)


#: Style names a plan may use: ours, and the ones transformers' shipped plans use (``base_model_tp_plan``), each made
#: fresh per module (the names also in ``options.TP_STYLE_NAMES``, for checks without torch). Inputs and outputs are
#: plain local tensors, as transformers' own styles leave them.
STYLE_NAMES: dict[str, Any] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence": SequenceParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # each rank gets the whole output
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),  # a whole input, split here
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocab rows sharded, ids whole
    "replicated_with_grad_allreduce": ReplicateShardedInput,
}


def resolve_style(style: ParallelStyle | str) -> ParallelStyle:
    """A ``ParallelStyle`` from a style or its name (:data:`STYLE_NAMES`)."""
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in STYLE_NAMES:
        return STYLE_NAMES[style]()
    raise ValueError(
        f"tensor-parallel style {style!r} is unknown; use a torch ParallelStyle or one of {sorted(STYLE_NAMES)}."
    )


def expand_plan(module: nn.Module, plan: TensorParallelPlan) -> dict[str, ParallelStyle]:
    """Resolve every pattern of ``plan`` to concrete module names of ``module``, keeping the plan's order.

    Raises:
        ValueError: A pattern matches no module (the message lists a few real names to pick from).
    """
    names = [name for name, _ in module.named_modules() if name]
    expanded: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        matches = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            sample = ", ".join(names[:8])
            raise ValueError(
                f"tensor-parallel plan pattern {pattern!r} matches no module of {type(module).__name__}; "
                f"fix the pattern (module names look like: {sample}, ...)."
            )
        for name in matches:
            expanded[name] = resolve_style(style)
    return expanded


def restrict_plan(module: nn.Module, plan: TensorParallelPlan) -> dict[str, ParallelStyle | str]:
    """The patterns of ``plan`` that match a module of ``module`` (a pipeline stage holds only part of the model).

    Check the whole plan against the whole model first (:func:`expand_plan`), so a typo still fails.
    """
    names = [name for name, _ in module.named_modules() if name]
    return {pattern: style for pattern, style in plan.items() if any(fnmatch.fnmatchcase(n, pattern) for n in names)}


class ReplicateParallel(ParallelStyle):
    """Keep a module's parameters whole on every tp rank, as replicated DTensors.

    Modules the plan does not shard (norms without sequence parallelism, a user's small layers) would otherwise
    keep plain parameters next to DTensor ones, which optimizers, gradient clipping and checkpoints cannot mix.
    Inputs are wrapped as replicated DTensors and outputs unwrapped, so the module runs unchanged.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._wrap_inputs, output_fn=unwrap_outputs)

    @staticmethod
    def _wrap_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )


def unwrap_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    """A module's DTensor outputs as this rank's plain tensors (the styles here hand plain tensors on), in a tuple
    or list too (transformers' MoE routers return ``(logits, scores, indices)``)."""
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(unwrap_outputs(module, output, mesh) for output in outputs)
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> dict[str, str]:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following ``plan``; replicate what the plan leaves.

    Returns:
        The concrete module names and the style applied to each (for logs and the layout table).
    """
    expanded = expand_plan(module, plan)
    for name, style in expanded.items():
        try:
            parallelize_module(module, tp_mesh, {name: style})
        except (NotImplementedError, ValueError, TypeError, AttributeError) as err:
            layer = type(module.get_submodule(name)).__name__
            raise ValueError(
                f"tensor-parallel plan: {name} ({layer}) cannot take {type(style).__name__}: {err}; change that "
                f"pattern (torch's colwise / rowwise styles take nn.Linear and nn.Embedding) or leave {name} out "
                "of the plan to replicate it."
            ) from err
    leftovers = {
        name: ReplicateParallel()
        for name, child in module.named_modules()
        if name and any(not isinstance(p, DTensor) for p in child.parameters(recurse=False))
    }
    if leftovers:
        parallelize_module(module, tp_mesh, leftovers)
    return {name: type(style).__name__ for name, style in {**expanded, **leftovers}.items()}


def reduce_partial_grads(parameters: Iterable[nn.Parameter]) -> int:
    """Sum gradients left as partial sums over a mesh axis, in one all-reduce per axis; returns how many.

    Under sequence parallelism a replicated weight (a norm) used on sequence shards gets a ``Partial`` gradient.
    DTensor reduces it lazily, again in every op that reads it: the gradient norm and each of AdamW's foreach ops
    each all-reduce every such gradient (21 calls per step for the 2-block GPT at tp2). FSDP2 reduces them in its
    post-backward; without it, this does it once, before the gradient is read.
    """
    pending: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
            continue
        if any(p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" for p in grad.placements):
            param.grad = grad.redistribute(placements=param.placements)  # not a sum: leave it to DTensor
            continue
        pending.setdefault((grad.device_mesh, grad.placements, grad.dtype), []).append(param)
    for (mesh, placements, _dtype), params in pending.items():
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in params])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for param in params:
            local = param.grad.to_local()
            summed = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            param.grad = DTensor.from_local(
                summed, mesh, param.placements, run_check=False, shape=param.grad.shape, stride=param.grad.stride()
            )
    return sum(len(params) for params in pending.values())
