"""What a run trains and on what: the built-in GPT and data, a user's own classes, or a HuggingFace model.

The app's model and data come from ``cfg.model`` / ``cfg.data``: a :class:`~lightning_dist.models.gpt.GPTConfig` /
:class:`~lightning_dist.data.config.DataConfig` (the built-in options), a
:class:`~lightning_dist.config.schema.TargetConfig` (``model=custom`` / ``data=custom``: your LightningModule /
LightningDataModule, built by Hydra), or an :class:`~lightning_dist.config.schema.HFModelConfig` (``model=hf``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_dist import _compat
from lightning_dist.checkpoint.weights import is_hf_folder
from lightning_dist.config.pretrained import pretrained_folder
from lightning_dist.config.schema import HFModelConfig, TrainConfig
from lightning_dist.data import TokenDataModule
from lightning_dist.data.config import DataConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.hf import TINY_CONFIGS, HFCausalLM
from lightning_dist.models.module import GPTModule


def num_blocks(model: Any) -> int | None:
    """Blocks a pipeline can split the model into, where the config says (None for a user's own module)."""
    if isinstance(model, GPTConfig):
        return model.n_layers
    if isinstance(model, HFModelConfig):
        return hf_config(model).num_hidden_layers
    return None


def build_module(cfg: TrainConfig) -> pl.LightningModule:
    """The LightningModule of the run (built on every rank after seeding, so every rank starts from the same one)."""
    model, source = cfg.model, hf_source(cfg)
    if isinstance(model, GPTConfig):
        return GPTModule(model, cfg.optim, cfg.trainer.max_steps, init_seed=cfg.seed, hf_source=source)
    if isinstance(model, HFModelConfig):
        # Built in configure_model (on the meta device under our layouts); every weight is read after it when the
        # run starts from weights (init_from, which model.pretrained sets) or continues from a checkpoint.
        loaded = cfg.init_from is not None or cfg.ckpt_path is not None
        return HFCausalLM(hf_config(model), cfg.optim, cfg.trainer.max_steps, init_seed=cfg.seed,
                          random_init=not loaded, hf_source=source)  # fmt: skip
    module = model.build()
    if not isinstance(module, pl.LightningModule):
        raise ValueError(
            f"model._target_={model.target!r} built a {type(module).__name__}, not a LightningModule; point it at "
            "your LightningModule class."
        )
    return module


def hf_source(cfg: TrainConfig) -> str | None:
    """The HuggingFace folder the run's weights come from (``init_from`` / ``model.pretrained``), else ``None``."""
    if cfg.init_from is not None and is_hf_folder(Path(cfg.init_from)):
        return str(Path(cfg.init_from).expanduser().resolve())
    if isinstance(cfg.model, HFModelConfig) and cfg.model.pretrained is not None:
        return str(pretrained_folder(cfg.model.pretrained))
    return None


def build_datamodule(cfg: TrainConfig) -> pl.LightningDataModule:
    """The run's data: the built-in TokenDataModule, or the user's DataModule."""
    if isinstance(cfg.data, DataConfig):
        return TokenDataModule(cfg.data, seed=cfg.seed)
    datamodule = cfg.data.build()
    if not isinstance(datamodule, pl.LightningDataModule):
        raise ValueError(
            f"data._target_={cfg.data.target!r} built a {type(datamodule).__name__}, not a LightningDataModule; "
            "point it at your LightningDataModule class."
        )
    return datamodule


def hf_config(model: HFModelConfig) -> Any:
    """The transformers config of ``model=hf``: ``model.config`` (a built-in tiny one, or read from a local path),
    else the pretrained folder's, else ``tiny_llama``. Never downloaded."""
    try:
        import transformers
    except ImportError:
        raise ValueError("model=hf needs transformers; pip install 'lightning-dist[hf]'.") from None

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
    _compat.set_attn_implementation(config, model.attn_implementation)
    return config


#: HuggingFace model types whose layout the built-in GPT's ``arch=llama`` has (the planner estimates them as it).
LLAMA_LIKE = ("llama", "mistral", "qwen2")


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
