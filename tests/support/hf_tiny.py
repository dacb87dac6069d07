"""A tiny config for every causal-LM family the installed transformers has (nothing downloaded), for the family
matrix (``tests/support/hf_matrix.py``) and the family tests.

The widths are the same for every family (hidden 64, 4 layers, 4 heads, 2 kv heads, head_dim 16, vocab 256, a sliding
window of 8, 4 experts top-2 where the family has them); per-layer attention types are mixed where the family has
them; dropout is off (curves are compared across layouts). The per-family overrides were found by trial on
transformers 5.24 (a survey of all 196 causal-LM entries).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

N_LAYERS = 4
H = 64
# generic overrides: field name -> value (only applied when the field exists on the config dataclass)
GENERIC = {
    # widths
    "hidden_size": H,
    "n_embd": H,
    "d_model": H,
    "dim": H,
    "emb_dim": H,
    "n_embed": H,
    "embed_dim": H,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "dim_ff": 128,
    "dff": 128,
    "d_inner": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "feed_forward_size": 128,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "expert_ffn_hidden_size": 32,
    "shared_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    # depth
    "num_hidden_layers": N_LAYERS,
    "n_layer": N_LAYERS,
    "n_layers": N_LAYERS,
    "num_layers": N_LAYERS,
    "decoder_layers": N_LAYERS,
    "encoder_layers": 2,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "multi_query_group_num": 2,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    # lengths
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "max_seq_len": 256,
    "max_target_positions": 256,
    "max_source_positions": 256,
    "context_length": 256,
    "original_max_position_embeddings": 256,
    # vocab
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "unpadded_vocab_size": 256,
    # sliding windows
    "sliding_window": 8,
    "sliding_window_size": 8,
    "attention_window_size": 8,
    "local_attention_window_len": 8,
    "attention_chunk_size": 8,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    # MLA
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_topk": 8,
    "index_head_dim": 16,
    "index_n_heads": 2,
    # SSM-ish
    "mamba_d_ssm": 64,
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "time_step_rank": 8,
    "hidden_size_per_layer_input": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "hc_lowrank": 8,
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# per-family extra overrides (found by trial)
FAMILY = {
    "qwen2": {"use_sliding_window": True, "max_window_layers": 2},
    "qwen2_moe": {"use_sliding_window": True, "max_window_layers": 2},
    "qwen3": {"use_sliding_window": True, "max_window_layers": 2},
    "qwen3_moe": {"use_sliding_window": True, "max_window_layers": 2},
    "bert": {"is_decoder": True},
    "bert-generation": {"is_decoder": True},
    "big_bird": {"is_decoder": True},
    "camembert": {"is_decoder": True},
    "data2vec-text": {"is_decoder": True},
    "electra": {"is_decoder": True},
    "ernie": {"is_decoder": True},
    "megatron-bert": {"is_decoder": True},
    "rembert": {"is_decoder": True},
    "roberta": {"is_decoder": True},
    "roberta-prelayernorm": {"is_decoder": True},
    "roc_bert": {"is_decoder": True},
    "roformer": {"is_decoder": True},
    "xlm-roberta": {"is_decoder": True},
    "xlm-roberta-xl": {"is_decoder": True},
    "xmod": {"is_decoder": True},
    "reformer": {"is_decoder": True},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    "zaya": {"num_experts_per_tok": 1},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gemma4_text": {"global_head_dim": 16},
    "gemma4_unified_text": {"global_head_dim": 16},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "zamba2": {"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": 4},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]], "window_size": 8},
    "mamba2": {"head_dim": 32},
    "gemma3n_text": {
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
}


def field_names(C):
    try:
        return {f.name: f for f in dataclasses.fields(C)}
    except TypeError:
        return {}


def resolve_classes(mt):
    """Return (config_class_to_build, causal_lm_class, note)."""
    M = getattr(transformers, NAMES[mt])
    C = CONFIG_MAPPING[mt]
    cc = getattr(M, "config_class", None)
    note = None
    if cc is not None and cc is not C and not issubclass(C, cc):
        subs = getattr(C, "sub_configs", {}) or {}
        if subs:
            note = f"mapping config {C.__name__} is composite; built the model's own config_class {cc.__name__}"
            C = cc
        else:
            note = f"mapping config {C.__name__} used with {M.__name__} (config_class {cc.__name__}) as AutoModel does"
    return C, M, note


def tiny_kwargs(mt, C):
    flds = field_names(C)
    amap = getattr(C, "attribute_map", {}) or {}
    kw = {}
    for k, v in GENERIC.items():
        tgt = k if k in flds else None
        if tgt is None and k in amap and amap[k] in flds:
            tgt = amap[k]
        if tgt is not None and tgt not in kw:
            kw[tgt] = v
    for k, v in TOKEN_IDS.items():
        if k in flds:
            d = flds[k].default
            if d is not None and d is not dataclasses.MISSING:
                kw[k] = v
    if "kv_lora_rank" in flds and "num_key_value_heads" in flds:
        kw["num_key_value_heads"] = 4  # MLA: eager path expects kv heads == heads
    kw.update(FAMILY.get(mt, FAMILY.get(mt + "_text", {})))
    # some configs use both head_dim and hidden/heads: keep consistent (64/4 = 16)
    return kw


MIXED = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]


def make_config(mt):
    C, M, note = resolve_classes(mt)
    kw = tiny_kwargs(mt, C)
    cfg = C(**kw)
    # make per-layer attention types mixed (and non-periodic) where the family has `layer_types` but the tiny
    # default came out uniform full/sliding attention
    lt = getattr(cfg, "layer_types", None) if "layer_types" in field_names(C) else None
    if (
        isinstance(lt, list)
        and len(set(lt)) == 1
        and lt[0] in ("full_attention", "sliding_attention")
        and "layer_types" not in kw
    ):
        try:
            kw2 = dict(kw, layer_types=list(MIXED))
            cfg2 = C(**kw2)
            m2 = M(cfg2).eval()
            with torch.no_grad():
                m2(input_ids=torch.randint(3, 200, (1, 12)), use_cache=False)
            cfg, kw = C(**kw2), kw2
        except Exception:  # family rejects mixed layer types: keep uniform
            pass
    return cfg, C, M, note, kw


# categories (decided by reading the classes; see REPORT.md)
ENC_DEC_DECODER = {
    "bart",
    "bigbird_pegasus",
    "blenderbot",
    "blenderbot-small",
    "marian",
    "mbart",
    "mvp",
    "pegasus",
    "plbart",
    "prophetnet",
    "trocr",
    "whisper",
    "musicgen",
    "musicgen_melody",
}
ENCODER_AS_DECODER = {
    "bert",
    "bert-generation",
    "big_bird",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "megatron-bert",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xmod",
    "xlm",
}
MULTIMODAL = {
    "fuyu",
    "gemma3",
    "gemma3n",
    "gemma4",
    "gemma4_unified",
    "git",
    "got_ocr2",
    "moss_transcribe_diarize",
    "phi4_multimodal",
}
SPECIAL = {
    "reformer": "LSH/axial-position Reformer (needs axial_pos_shape etc.)",
    "blt": "Byte Latent Transformer: patcher + local encoder/decoder + global transformer, not a plain decoder stack",
    "xlnet": "permutation LM with two-stream attention / mems",
    "gemma4_assistant": "draft/assistant model fed by a backbone's hidden states",
    "gemma4_unified_assistant": "draft/assistant model fed by a backbone's hidden states",
    "cpmant": "CPM-Ant: segment/span inputs and bucketed position bias",
}
SSM_OR_RECURRENT = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}


def category(mt):
    if mt in ENC_DEC_DECODER:
        return "enc-dec decoder"
    if mt in ENCODER_AS_DECODER:
        return "encoder used as decoder"
    if mt in MULTIMODAL:
        return "multimodal"
    if mt in SPECIAL:
        return "special"
    if mt in SSM_OR_RECURRENT:
        return "ssm/recurrent (no attention)"
    return "decoder-only"


def tiny_config(model_type: str, windowless: bool = False) -> Any:
    """The tiny config of ``model_type``: dropout off, multipliers and logit scaling away from 1 and soft-caps low
    (so that code which skips one shows), the attention implementation the family supports; ``windowless``: its
    sliding windows off (every layer full attention), as context parallelism asks of a config (a window there is
    refused by the config's own one-line check, whatever the family)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config, _, model_class, _, _ = make_config(model_type)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
        elif "multiplier" in key and "dim" not in key and isinstance(value, float):
            setattr(config, key, 0.5)  # muP-style scales (Granite, Falcon-H1): a 1.0 would hide a stage that drops one
        elif key == "logits_scaling" and isinstance(value, float):
            setattr(config, key, 2.0)
        elif key.endswith("softcapping") and isinstance(value, (int, float)) and value:
            setattr(config, key, 0.5)  # Gemma2's 30 / 50 leave a tiny model's logits and scores as they are
    if windowless:
        for key in ("sliding_window", "sliding_window_size"):
            if getattr(config, key, None) is not None:
                setattr(config, key, None)
        if getattr(config, "use_sliding_window", None):
            config.use_sliding_window = False
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = [t.replace("sliding_attention", "full_attention") for t in config.layer_types]
    config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    return config


def decoder_families() -> list[str]:
    """Every causal-LM model type of the installed transformers that is a decoder-only stack (or an SSM)."""
    return sorted(mt for mt in NAMES if category(mt) in ("decoder-only", "ssm/recurrent (no attention)"))
