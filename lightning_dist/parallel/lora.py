"""Tensor parallelism for low-rank adapters: each adapter pair sharded consistently with the layer it adapts.

A LoRA layer (peft's, or any module laid out the same way) computes ``base_layer(x) + B(A(drop(x))) * s`` and holds
``base_layer``, and ``lora_A`` / ``lora_B`` as dicts of linear layers by adapter name. A plan entry for the layer
applies its style to ``base_layer``, and to the adapters the styles that make their output land exactly where the
base layer's does, with the gradients of one process:

- **colwise base** (weight rows = output features sharded; input whole, output sharded on its last dim):
  A (r x in) replicated, taking the base's input layout (a sequence-sharded input marked so, its gradient summed
  over tp); B (out x r) colwise with the base's output layout, so ``B A x`` comes out sharded like ``W x``. The
  input's gradient through A is summed over tp by B's input hook, as the base's is.
- **rowwise base** (weight columns = input features sharded; input sharded on its last dim, output summed over
  tp, or reduce-scattered onto the sequence under sequence parallelism): A (r x in) rowwise with the base's input and
  output layouts (its ``r``-wide output summed over tp: ``r / out`` of the base's all-reduce), B (out x r) replicated
  on that output (marked sequence-sharded where it is, so B's gradient is summed over tp).

Any other style on an adapted layer (an embedding, a Conv1D, sequence parallelism of a norm) is refused in one line.
No model code here, no peft: the layout is read off the module.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_dist.parallel.tensor import ReplicateParallel, ReplicateShardedInput


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA layer: a ``base_layer`` with ``lora_A`` / ``lora_B`` dicts of adapters."""
    return all(hasattr(module, attr) for attr in ("base_layer", "lora_A", "lora_B")) and isinstance(
        module.lora_A, nn.ModuleDict
    )


def adapter_plan(module: nn.Module, expanded: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``expanded`` (module name -> style) with each LoRA layer's entry replaced by its base layer's and its adapters'
    (see the module docstring); other entries unchanged.

    Raises:
        ValueError: An adapted layer whose style has no adapter rule (one line naming it).
    """
    plan: dict[str, ParallelStyle] = {}
    for name, style in expanded.items():
        layer = module.get_submodule(name)
        if not is_lora_layer(layer):
            plan[name] = style
            continue
        plan[f"{name}.base_layer"] = style
        for adapter in layer.lora_A:
            a_style, b_style = _adapter_styles(name, style)
            plan[f"{name}.lora_A.{adapter}"] = a_style
            plan[f"{name}.lora_B.{adapter}"] = b_style
    return plan


def _adapter_styles(name: str, style: ParallelStyle) -> tuple[ParallelStyle, ParallelStyle]:
    kind = type(style)
    local = getattr(style, "use_local_output", False)
    if kind in (ColwiseParallel, RowwiseParallel) and local:
        (given,), (output,) = style.input_layouts, style.output_layouts
        if kind is ColwiseParallel:
            a_style = ReplicateParallel() if isinstance(given, Replicate) else _sharded_input(given)
            return a_style, ColwiseParallel(input_layouts=given, output_layouts=output)
        a_style = RowwiseParallel(input_layouts=given, output_layouts=output)
        b_style = ReplicateParallel() if isinstance(output, Replicate) else _sharded_input(output)
        return a_style, b_style
    raise ValueError(
        f"model.lora.targets: {name} is sharded with {kind.__name__}{'' if local else ' (DTensor output)'} under "
        "tensor parallelism, which has no adapter rule (colwise / rowwise linear layers do); leave it out of "
        "model.lora.targets, or use tp=1."
    )


def _sharded_input(layout: object) -> ParallelStyle:
    if not isinstance(layout, Shard):
        raise ValueError(f"an adapter's input laid out as {layout} has no adapter rule; use tp=1 for model.lora.")
    return ReplicateShardedInput(layout.dim)
