"""QLoRA: the frozen base of a LoRA model stored in 4 bits (torchao's NF4), the adapters trained beside it.

:func:`quantize_base` turns the weight of every linear layer of the decoder blocks (the layers peft adapted, under
``base_layer``, and any other) into torchao's ``NF4Tensor`` (``to_nf4``: blocks of 64 values, each a 4-bit index
into the NormalFloat code book times a block scale, the scales themselves quantized to 8 bits in groups of 256: the
QLoRA paper's double quantization), a frozen parameter of about 0.52 bytes per value. A linear layer then computes
with the weight dequantized on the fly to its input's dtype (torchao's ``F.linear`` override), so peft's LoRA layer
runs ``W_nf4 x + (alpha / r) B A x`` and the backward gives gradients to the adapters (and the input) only. The
embedding, the output head, the norms and biases keep their dtype, as in QLoRA.

It runs once the weights are in place (``on_fit_start``, after a pretrained folder was read and a ``bf16-true``
precision applied): each weight is quantized from its whole, loaded value, on every layout alike. A checkpoint holds
the NF4 tensors themselves (DCP saves and loads them as they are), so a resumed run continues on the same 4-bit
base bit for bit; reading them into a plain tensor (an export) gives their dequantized values.

Needs torchao (``lightning-dist[qlora]``). No distributed code here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dist.models.lora_config import NF4_BLOCK as BLOCK
from lightning_dist.models.lora_config import NF4_SCALER_BLOCK as SCALER_BLOCK

#: The checkpoint key naming its NF4 tensors (the module's names), so a reader gives them NF4 targets.
NF4_NAMES = "nf4_tensors"


def is_nf4(tensor: Tensor) -> bool:
    """Whether ``tensor`` is torchao's ``NF4Tensor`` (a QLoRA base weight)."""
    return type(tensor).__name__ == "NF4Tensor"


def quantizable(numel: int) -> bool:
    """Whether a weight of ``numel`` values splits into whole NF4 blocks and whole groups of scales."""
    return numel % (BLOCK * SCALER_BLOCK) == 0


def base_linears(model: nn.Module, blocks: str) -> dict[str, nn.Linear]:
    """The linear layers below ``blocks`` (the decoder layers) that are not adapters, by name: the frozen base."""
    prefix = f"{blocks}." if blocks else ""
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith(prefix) and isinstance(module, nn.Linear) and ".lora_" not in name
    }


def quantize_base(model: nn.Module, blocks: str, kind: str = "nf4") -> list[str]:
    """Store the weight of every frozen linear layer below ``blocks`` as torchao's NF4 in place (the adapters, the
    embedding, the head and the norms are left as they are); layers already quantized are skipped. Returns the names
    of the layers quantized now.

    Args:
        model: The network, LoRA already applied (the base frozen), its weights loaded.
        blocks: Path of the decoder-layer container in ``model``.
        kind: ``model.lora.quantize``; ``nf4`` only.

    Raises:
        ValueError: A base layer that is trained, or whose weight does not split into NF4's blocks (one line).
    """
    from torchao.quantization import to_nf4  # optional dependency: lightning-dist[qlora]

    if kind != "nf4":
        raise ValueError(f"model.lora.quantize={kind!r} is unknown; use nf4 or null.")
    prefix = f"{blocks}." if blocks else ""
    for name, module in model.named_modules():
        if name.startswith(prefix) and type(module).__name__ == "Conv1D":  # GPT-2's transposed linear layer
            raise ValueError(
                f"model.lora.quantize={kind}: {name} is transformers' Conv1D, which torchao's NF4 does not compute "
                "with; use a Llama-style family or model.lora.quantize=null."
            )
    done = []
    for name, layer in base_linears(model, blocks).items():
        weight = layer.weight
        if is_nf4(weight):
            continue
        if type(weight).__name__ == "DTensor":  # sharded by FSDP2 / TP: its whole value is not here
            raise ValueError(
                f"model.lora.quantize={kind}: {name}.weight is a sharded DTensor; QLoRA quantizes "
                "whole weights: the module's unsharded_parameters() must name it (FSDP2 then leaves it whole)."
            )
        if weight.requires_grad:
            raise ValueError(
                f"model.lora.quantize={kind}: {name}.weight is trained; QLoRA quantizes a frozen base only "
                "(give model.lora.rank > 0, and no layer of the blocks trained in full)."
            )
        if not quantizable(weight.numel()):
            raise ValueError(
                f"model.lora.quantize={kind}: {name}.weight has {weight.numel()} values, not a multiple of "
                f"{BLOCK * SCALER_BLOCK} (NF4's blocks of {BLOCK} in groups of {SCALER_BLOCK}); set "
                "model.lora.quantize=null for this model."
            )
        layer.weight = nn.Parameter(to_nf4(weight.detach(), BLOCK, SCALER_BLOCK), requires_grad=False)
        done.append(name)
    return done


def nf4_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s NF4 parameters (``state_dict`` names), for a checkpoint's :data:`NF4_NAMES`."""
    return [name for name, param in module.named_parameters() if is_nf4(param)]


def nf4_target(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """An NF4 tensor of ``shape`` for DCP to load a saved NF4 tensor into (torchao's ``copy_`` takes another NF4
    tensor's parts only when the shapes and blocks agree; a plain target cannot hold one)."""
    from torchao.quantization import to_nf4  # also lets torch.load unpickle an NF4Tensor (torchao's safe global)

    return to_nf4(torch.ones(shape, dtype=dtype), BLOCK, SCALER_BLOCK)


def dequantized(tensor: Tensor) -> Tensor:
    """The values a QLoRA base weight computes with (``tensor`` itself when it is not NF4)."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor
