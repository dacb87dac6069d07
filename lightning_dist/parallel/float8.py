"""float8 training of the blocks' linear layers through torchao (``parallelism.float8``), as torchtitan does it.

Step 0 of :func:`lightning_dist.parallel.compose.parallelize`, before tensor parallelism: every ``nn.Linear`` inside
the blocks becomes torchao's ``Float8Linear`` (same module name, same high-precision weight), whose matmuls cast their
inputs, weights and output gradients to float8 with dynamic scales. The embeddings and the output head are left as
they are (their precision matters most, and the head's matmul is the loss's). Then:

- **tensorwise** (one scale per tensor): under FSDP2 the weights are all-gathered in float8 (torchao's
  ``enable_fsdp_float8_all_gather``: 1 byte per element instead of the compute dtype's 2 or 4, the scale from an
  all-reduce of the shards' amax), and under TP the column / row styles of the converted layers become torchao's
  ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` (float8 inputs to the sharded matmuls);
- **rowwise** (one scale per row of each operand: closer to bf16, slower on H100): FSDP2 gathers in the compute
  dtype, TP keeps torch's styles (DTensor runs the float8 matmul per shard).

Off CUDA compute capability 8.9+ (and on CPU) torchao emulates the float8 matmuls (``emulate=True``: the same casts
and scales, the products in high precision): the numbers a float8 GPU run computes up to the matmul's own rounding,
without its speed. Parameters, gradients, optimizer state and checkpoints keep their dtype (torchao keeps the
high-precision weight), so a float8 run resumes without float8 and back. Needs ``pip install
'lightning-dist[float8]'`` (torchao).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

#: How far a float8 run's loss may be from the high-precision run's at the same step (relative): measured 1.33%
#: (tensorwise) and 0.91% (rowwise) at worst over 300 steps of a 2-block GPT on the synthetic Markov data against
#: fp32 on the CPU (0.22% / 0.19% for 20-step averages; ``benchmarks/float8_curve.py``), held at 3%.
FLOAT8_LOSS_RTOL = 0.03
#: torchao's float8 matmul (``torch._scaled_mm``) takes dims divisible by 16: other linears stay as they are (as
#: torchtitan's filter), on every device, so CPU and GPU runs convert the same layers.
FLOAT8_MULTIPLE = 16


def float8_config(recipe: str, device_type: str, fsdp: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``tensorwise`` / ``rowwise``) on ``device_type``.

    Args:
        recipe: torchao's recipe name.
        device_type: ``cuda`` runs real float8 matmuls on compute capability 8.9+; anything else emulates them.
        fsdp: FSDP2 shards the parameters: tensorwise then all-gathers the converted weights in float8.
    """
    try:
        from torchao.float8 import Float8LinearConfig  # optional: lightning-dist[float8]
    except ImportError as err:
        raise ValueError(
            f"float8={recipe} needs torchao ({err}); pip install 'lightning-dist[float8]', or set float8=off."
        ) from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    emulate = not (device_type == "cuda" and torch.cuda.get_device_capability() >= (8, 9))
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def convertible(linear: nn.Linear) -> bool:
    """Whether torchao's float8 matmul takes this layer's shapes (both dims multiples of 16)."""
    return linear.in_features % FLOAT8_MULTIPLE == 0 and linear.out_features % FLOAT8_MULTIPLE == 0


def apply_float8(blocks: Sequence[nn.Module], recipe: str, device_type: str, fsdp: bool) -> str:
    """Convert the ``nn.Linear`` layers inside ``blocks`` to torchao's ``Float8Linear``, in place (names kept).

    Returns:
        What was converted, in words (for the rank's layout): the recipe, the layer count, emulated or not.

    Raises:
        ValueError: No blocks to convert, or torchao is missing (one line each).
    """
    if not blocks:
        raise ValueError(
            f"float8={recipe} converts the linear layers of the model's blocks: define pipeline_spec() on the module "
            "(its blocks_attr names them), or set float8=off."
        )
    from torchao.float8 import convert_to_float8_training  # optional: lightning-dist[float8]

    config = float8_config(recipe, device_type, fsdp)
    converted = 0
    for block in blocks:
        before = sum(isinstance(m, nn.Linear) for m in block.modules())
        convert_to_float8_training(block, config=config, module_filter_fn=_filter)
        converted += before - sum(type(m) is nn.Linear for m in block.modules())
    how = "emulated" if config.emulate else "float8 matmuls"
    gather = ", FSDP2 all-gathers in float8" if config.enable_fsdp_float8_all_gather else ""
    return f"float8 {recipe}: {converted} linear layers of {len(blocks)} blocks ({how}{gather})"


def _filter(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and convertible(module)


def float8_tp_styles(module: nn.Module, styles: dict[str, ParallelStyle], recipe: str) -> dict[str, ParallelStyle]:
    """``styles`` (concrete module name -> style) with the column / row styles of converted layers replaced by
    torchao's float8 ones under ``tensorwise`` (same layouts: the sharded matmuls take float8 inputs); unchanged
    otherwise."""
    if recipe != "tensorwise":
        return styles
    from torchao.float8.float8_linear import Float8Linear  # optional: lightning-dist[float8]
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swapped = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out: dict[str, ParallelStyle] = {}
    for name, style in styles.items():
        target = swapped.get(type(style))
        if target is not None and isinstance(module.get_submodule(name), Float8Linear):
            float8_style = target.__new__(target)
            float8_style.__dict__.update(style.__dict__)  # the same input / output layouts and local output
            style = float8_style
        out[name] = style
    return out


def check_float8_collectives(options: Any, tp_mesh: Any) -> None:
    """Refuse in one line what gloo cannot carry: tensorwise TP with sequence parallelism all-gathers float8
    gradients (torchao's styles), and gloo has no float8 dtypes (``RuntimeError: Invalid scalar type``)."""
    backend = torch.distributed.get_backend(tp_mesh.get_group())
    if options.float8 == "tensorwise" and options.tensor.sequence_parallel and backend == "gloo":
        raise ValueError(
            "float8=tensorwise with tp and sequence_parallel=true all-gathers float8 gradients, which gloo cannot "
            "carry; use nccl (CUDA), sequence_parallel=false, or float8=rowwise."
        )


def high_precision_state(state: Any) -> Any:
    """``state`` (nested dicts / lists of a checkpoint) with torchao's float8 weight wrappers replaced by the
    high-precision tensors they hold (the same storage): tensorwise FSDP2 parameters, and the AdamW moments made like
    them, are ``WeightWithDynamicFloat8CastTensor``s, which a checkpoint would pickle as such (unreadable without
    torchao, refused by ``torch.load(weights_only=True)``). Loading writes into the wrappers in place."""
    if isinstance(state, dict):
        return {key: high_precision_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [high_precision_state(value) for value in state]
    if not isinstance(state, torch.Tensor):
        return state
    local = state.to_local() if isinstance(state, DTensor) else state
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # optional: lightning-dist[float8]
    except ImportError:
        return state
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return state
    names, _ = local.__tensor_flatten__()  # the wrapper subclass protocol: its one inner tensor
    inner = getattr(local, names[0])
    if not isinstance(state, DTensor):
        return inner
    return DTensor.from_local(inner, state.device_mesh, state.placements, shape=state.shape, stride=state.stride())


def converted_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s torchao ``Float8Linear`` layers."""
    try:
        from torchao.float8.float8_linear import Float8Linear  # optional: lightning-dist[float8]
    except ImportError:
        return []
    return [name for name, m in module.named_modules() if isinstance(m, Float8Linear)]
