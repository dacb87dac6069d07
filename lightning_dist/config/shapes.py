"""What a model config says about the model without building it: its blocks, its vocabulary and longest sequence, the
transformers config of ``model=hf``, and the GPT shape the planner estimates it as.

Plain Python for the built-in GPT, so the pre-launch check (:mod:`lightning_dist.config.validate`) reads a GPT's
shape without torch; ``model=hf`` needs transformers, imported where asked.
"""

from __future__ import annotations

from typing import Any

from lightning_dist import _compat
from lightning_dist.config.pretrained import pretrained_folder
from lightning_dist.config.schema import HFModelConfig
from lightning_dist.models.gpt_config import GPTConfig, MoEConfig


def num_blocks(model: Any) -> int | None:
    """Blocks a pipeline can split the model into, where the config says (None for a user's own module)."""
    if isinstance(model, GPTConfig):
        return model.n_layers
    if isinstance(model, HFModelConfig):
        return hf_config(model).num_hidden_layers
    return None


def hf_config(model: HFModelConfig) -> Any:
    """The transformers config of ``model=hf``: ``model.config`` (a built-in tiny one, or read from a local path),
    else the pretrained folder's, else ``tiny_llama``. Never downloaded."""
    try:
        import transformers
    except ImportError:
        raise ValueError("model=hf needs transformers; pip install 'lightning-dist[hf]'.") from None

    # deferred: the built-in tiny configs live with the HuggingFace adapter (torch, Lightning); only model=hf reads
    # them, and the launcher checks any other model without importing those (test_layering: DEFERRED)
    from lightning_dist.models.hf import TINY_CONFIGS

    name = model.config if model.config is not None or model.pretrained is not None else "tiny_llama"
    if name in TINY_CONFIGS:
        class_name, kwargs = TINY_CONFIGS[name]
        config = getattr(transformers, class_name)(**kwargs)
    elif name is None:
        config = transformers.AutoConfig.from_pretrained(pretrained_folder(model.pretrained), local_files_only=True)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        except OSError as err:
            raise ValueError(
                f"model.config={name!r} is neither a built-in tiny config ({', '.join(TINY_CONFIGS)}) nor a "
                f"local transformers config ({str(err).splitlines()[0]}); give a directory holding config.json."
            ) from None
    _compat.set_attn_implementation(config, attention_for(config, model.attn_implementation))
    return config


#: Llama-like MoE families the planner models as the GPT with MoE blocks (``_planned_moe``).
MOE_LIKE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: The config fields transformers' MoE families name their routed experts count by.
HF_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def check_hf_moe(config: Any, ep: int) -> None:
    """Raise a one-line ``ValueError`` where ``ep`` does not divide the routed experts of a transformers config (one
    naming its count otherwise is checked by the strategy, against the model's experts modules), or where the config
    asks for transformers' router auxiliary loss (``output_router_logits``), which lightning-dist does not add."""
    experts = next((getattr(config, name) for name in HF_EXPERT_COUNTS if getattr(config, name, None)), None)
    if isinstance(experts, int) and experts % ep:
        raise ValueError(
            f"parallelism.ep={ep} does not divide the {experts} experts of model=hf {config.model_type!r}; use an ep "
            "dividing it."
        )
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise ValueError(
            f"model=hf {config.model_type!r} has output_router_logits=true: transformers' router auxiliary loss is a "
            "statistic of each rank's micro batch (another layout, another loss), and lightning-dist trains the "
            "cross-entropy only; set output_router_logits=false in its config.json (or router_aux_loss_coef=0)."
        )


def attention_for(config: Any, asked: str) -> str:
    """The attention implementation to build ``config``'s model with: ``auto`` is the family's own choice (sdpa where
    its class supports it, else eager).

    Raises:
        ValueError: An implementation the family's class does not support (one line naming the field).
    """
    from lightning_dist.models.hf_init import causal_lm_class  # deferred: transformers' classes (model=hf only)

    model_class = causal_lm_class(config)
    supported = _compat.hf_supported_attention(model_class)
    if asked == "auto":
        return "sdpa" if "sdpa" in supported else "eager"
    if asked not in supported:
        raise ValueError(
            f"model.attn_implementation={asked}: {model_class.__name__} does not support it (it supports "
            f"{', '.join(sorted(supported))}); set model.attn_implementation=auto or one of those."
        )
    return asked


#: HuggingFace model types whose layout the built-in GPT's ``arch=llama`` has (the planner estimates them as it).
LLAMA_LIKE = ("llama", "mistral", "qwen2", *MOE_LIKE)


def _planned_moe(config: Any) -> MoEConfig:
    """The GPT MoE block of a Llama-like MoE family (``MOE_LIKE``): its routed and shared experts, top-k, routing;
    a dense config's is off. (Qwen3-MoE's and OLMoE's per-head q / k norms are left out: 2 x head_dim each.)"""
    if config.model_type not in MOE_LIKE:
        return MoEConfig()
    hidden = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return MoEConfig(
        num_experts=getattr(config, "num_local_experts", None) or config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden=hidden,
        shared_experts=shared // hidden,
        route_norm=bool(getattr(config, "norm_topk_prob", True)),
    )


def planned_model(model: Any) -> GPTConfig:
    """The built-in GPT shape the planner estimates ``model`` as: the GPT's own config, or a Llama-family
    HuggingFace model's (``model=hf``: same parameters, activations and collectives per block).

    Raises:
        ValueError: A model the planner has no shape for (a user's module, a HuggingFace model of another family).
    """
    if isinstance(model, GPTConfig):
        return model
    if isinstance(model, HFModelConfig):
        config = hf_config(model)
        if config.model_type not in LLAMA_LIKE:
            raise ValueError(
                f"the planner models Llama-family HuggingFace models ({', '.join(LLAMA_LIKE)}); model.config is a "
                f"{config.model_type!r}; plan with model=llama_8b-like GPT shapes instead."
            )
        heads = config.num_attention_heads
        return GPTConfig(
            arch="llama",
            vocab_size=config.vocab_size,
            n_layers=config.num_hidden_layers,
            d_model=config.hidden_size,
            n_heads=heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            ffn_hidden=config.intermediate_size,
            max_seq_len=config.max_position_embeddings,
            rope_theta=float(getattr(config, "rope_theta", 10000.0) or 10000.0),
            norm_eps=config.rms_norm_eps,
            tie_embeddings=bool(config.tie_word_embeddings),
            lora=model.lora,
            moe=_planned_moe(config),
        )
    raise ValueError(
        f"the planner models the built-in GPT and Llama-family HuggingFace models, not {type(model).__name__}; plan "
        "a GPT of the same shape (model=llama_8b, ... with model.* set)."
    )


def vocab_and_length(model: Any) -> tuple[int | None, int | None]:
    """The model's vocabulary size and longest sequence, where its config says (``None`` for a user's module)."""
    if isinstance(model, GPTConfig):
        return model.vocab_size, model.max_seq_len
    if isinstance(model, HFModelConfig):
        config = hf_config(model)
        return config.vocab_size, getattr(config, "max_position_embeddings", None)
    return None, None
