"""Building a transformers causal LM on the meta device, and giving any part of it its one-process values.

:func:`build_causal_lm` makes the model on the meta device (nothing allocated, nothing drawn); a strategy shards it or
splits it into stages, each rank allocates its own part, and :func:`init_causal_lm` fills that part: every parameter
drawn whole on the CPU from a generator seeded by its name, so a shard or a stage holds exactly its slice of what one
process draws, whatever the layout. The distribution is transformers' default initialization (``_init_weights``):
linear / ``Conv1D`` weights and embeddings ``N(0, initializer_range)`` (an embedding's padding row zero), biases zero,
norm scales one; GPT-2's residual projections (``c_proj``) scaled by ``1 / sqrt(2 * n_layer)``, as GPT-2 does. The
random numbers are not transformers' own (theirs come from the global generator in module order, which no sharded
rank can reproduce). Derived buffers (the rotary ``inv_freq`` tables) are computed again, never left empty.

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn


def causal_lm_class(config: Any) -> type[nn.Module]:
    """The transformers causal-LM class of ``config`` (``LlamaConfig`` -> ``LlamaForCausalLM``).

    Raises:
        ValueError: transformers has no causal LM for this config (one line).
    """
    import transformers  # optional dependency: lightning-dist[hf]

    try:
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(
            f"{type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}) has no causal-LM class in "
            "transformers; use a decoder-only model (Llama, Qwen2, Mistral, GPT-2, ...)."
        ) from None


def build_causal_lm(config: Any) -> nn.Module:
    """The causal LM of ``config`` on the meta device, in the current default dtype (the precision's).

    ``config.dtype`` (``torch_dtype``) is not applied: Lightning's precision decides the parameters' dtype.
    """
    with torch.device("meta"):  # transformers skips its initialization on the meta device
        return causal_lm_class(config)(config)


def retie(model: nn.Module) -> None:
    """Make the output head the input embedding's matrix again (``tie_word_embeddings``) where both are held.

    ``to_empty`` gives each module its own new tensor, so a tie must be made again after materializing.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and head is not None and head.weight is not embedding.weight:
        head.weight = embedding.weight


@torch.no_grad()
def init_causal_lm(model: nn.Module, seed: int, random: bool = True) -> None:
    """Give every parameter ``model`` holds its one-process value, and compute its rotary tables.

    Each parameter is drawn whole in float32 on the CPU from a generator seeded with
    ``zlib.crc32(f"{seed}:{name}")`` and copied into place (into a sharded DTensor: its slice, under
    ``implicit_replication``), so the values depend only on the seed, the name and the shape. A tied head on a
    pipeline stage without the embedding is drawn under its own name and then replaced by the embedding's owner (the
    strategy broadcasts tied copies).

    Args:
        model: The transformers model (whole, sharded, or a pipeline stage's pruned copy).
        seed: Base seed.
        random: ``False`` when every weight is read right after (a pretrained folder, a checkpoint): the parameters
            are only zeroed, which costs a memset instead of drawing the whole model on every rank.
    """
    retie(model)
    config = model.config
    std = getattr(config, "initializer_range", None) or 0.02
    for name, param in model.named_parameters():
        if not random:
            param.zero_()
            continue
        value = _initial_value(model, name, tuple(param.shape), std, seed)
        param.copy_(value.to(device=param.device, dtype=param.dtype))
    reset_rotary_buffers(model)


def _initial_value(model: nn.Module, name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The one-process value of the parameter ``name`` (transformers' default distribution, seeded by name)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    kind = type(module).__name__
    if leaf == "bias":
        return torch.zeros(shape, device="cpu")
    if "Norm" in kind:  # RMSNorm / LayerNorm of every family (transformers matches norms by name too)
        return torch.ones(shape, device="cpu")
    if getattr(model.config, "model_type", None) == "gpt2" and module_name.endswith("c_proj"):
        std = std / math.sqrt(2 * model.config.n_layer)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # one string: the generator keeps 32 bits
    value = torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)
    padding = getattr(module, "padding_idx", None) if isinstance(module, nn.Embedding) else None
    if padding is not None:
        value[padding] = 0.0
    return value


def reset_rotary_buffers(model: nn.Module) -> None:
    """Compute every rotary-embedding table again (``inv_freq`` and friends: non-persistent buffers, so neither a
    checkpoint nor a pretrained folder holds them, and ``to_empty`` left them uninitialized)."""
    for module in model.modules():
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "config"):
            continue
        with torch.device("cpu"):
            fresh = type(module)(module.config)  # a few hundred floats: the model's own rule, computed on the CPU
        for name, value in fresh.named_buffers():
            buffer = module.get_buffer(name)
            buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
