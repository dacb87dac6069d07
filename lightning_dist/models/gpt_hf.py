"""The built-in GPT in HuggingFace's names: ``arch=llama`` as ``LlamaForCausalLM``, ``gpt2`` as ``GPT2LMHeadModel``.

Only names, shapes and configs here (no I/O, no distributed code): :mod:`lightning_dist.checkpoint.export` streams
tensors through these maps, and ``init_from`` reads HuggingFace weights back through the inverse one.

Our RoPE rotates the pairs ``(x[i], x[i + D/2])`` like transformers' ``rotate_half``, so the Llama query and key
projections need no permutation (Meta's original checkpoints, which rotate adjacent pairs, would). GPT-2's
``Conv1D`` stores weights as (in, out) and fuses the query, key and value projections into ``c_attn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dist.models.gpt import GPTConfig

_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_LLAMA_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_GPT2_TOP = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}
#: GPT-2 layer tensors that map one to one (Conv1D weights transposed).
_GPT2_LAYER = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn.o_proj.weight": "attn.c_proj.weight",
    "attn.o_proj.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight",
    "mlp_norm.bias": "ln_2.bias",
    "mlp.up_proj.weight": "mlp.c_fc.weight",
    "mlp.up_proj.bias": "mlp.c_fc.bias",
    "mlp.down_proj.weight": "mlp.c_proj.weight",
    "mlp.down_proj.bias": "mlp.c_proj.bias",
}


@dataclass(frozen=True)
class Converted:
    """One HuggingFace tensor made from ``sources`` (our names, in order) by ``combine``."""

    name: str
    sources: tuple[str, ...]
    combine: Callable[..., Tensor]


def same(tensor: Tensor) -> Tensor:
    """The conversion of a tensor that keeps its name's layout: ``tensor`` itself."""
    return tensor


def _transposed(tensor: Tensor) -> Tensor:
    return tensor.t().contiguous() if tensor.dim() == 2 else tensor


def _fused_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return _transposed(torch.cat([q, k, v], dim=0))  # weight: (3C, C) -> Conv1D (C, 3C); bias: (3C,)


def hf_tensors(cfg: GPTConfig) -> list[Converted]:
    """Every tensor of the HuggingFace model, in order, with the GPT tensors it is made from.

    A tied head is left out (transformers re-ties ``lm_head`` to the embedding when it loads).

    Raises:
        ValueError: The GPT has no HuggingFace counterpart (GPT-2 layout with grouped-query attention).
    """
    layers = range(cfg.n_layers)
    if cfg.arch == "llama":
        top = {o: t for o, t in _LLAMA_TOP.items() if not (cfg.tie_embeddings and o == "head.weight")}
        out = [Converted(theirs, (ours,), same) for ours, theirs in top.items()]
        for i in layers:
            out += [Converted(f"model.layers.{i}.{t}", (f"layers.{i}.{o}",), same) for o, t in _LLAMA_LAYER.items()]
        return out
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"model.n_kv_heads={cfg.n_kv_heads}: GPT-2 has no grouped-query attention, so this GPT has no HuggingFace "
            "counterpart; export it with --format torch."
        )
    top = {o: t for o, t in _GPT2_TOP.items() if not (cfg.tie_embeddings and o == "head.weight")}
    out = [Converted(theirs, (ours,), same) for ours, theirs in top.items()]
    for i in layers:
        prefix = f"layers.{i}.attn."
        for kind in ("weight", "bias"):
            sources = tuple(f"{prefix}{p}_proj.{kind}" for p in "qkv")
            out.append(Converted(f"transformer.h.{i}.attn.c_attn.{kind}", sources, _fused_qkv))
        for ours, theirs in _GPT2_LAYER.items():
            out.append(Converted(f"transformer.h.{i}.{theirs}", (f"layers.{i}.{ours}",), _transposed))
    return out


def from_hf_names(cfg: GPTConfig) -> dict[str, str]:
    """Our tensor name -> the HuggingFace tensor holding it unchanged (``arch=llama``; the head may read the
    embedding when tied), for reading HuggingFace weights into a GPT of any layout.

    Raises:
        ValueError: ``arch=gpt2`` (its fused, transposed tensors cannot be read slice by slice into a sharded GPT).
    """
    if cfg.arch != "llama":
        raise ValueError(
            f"init_from a HuggingFace folder needs model.arch=llama (got {cfg.arch!r}): GPT-2's fused c_attn cannot be "
            "read into a sharded GPT; start from a lightning-dist checkpoint folder instead."
        )
    names = {c.sources[0]: c.name for c in hf_tensors(cfg)}
    if cfg.tie_embeddings:
        names["head.weight"] = "model.embed_tokens.weight"  # a pipeline's last stage holds its own copy
    return names


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """The HuggingFace ``config.json`` content of the GPT (``architectures`` and ``model_type`` included)."""
    if cfg.arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.hidden_dim,
        "activation_function": "gelu_new",  # the tanh approximation our MLP uses
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }
