"""What a run trains and on what: the built-in GPT and data, a user's own classes, or a HuggingFace model.

The app's model and data come from ``cfg.model`` / ``cfg.data``: a :class:`~lightning_dist.models.gpt.GPTConfig` /
:class:`~lightning_dist.data.config.DataConfig` (the built-in options), a
:class:`~lightning_dist.config.schema.TargetConfig` (``model=custom`` / ``data=custom``: your LightningModule /
LightningDataModule, built by Hydra), or an :class:`~lightning_dist.config.schema.HFModelConfig` (``model=hf``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_dist import _compat
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
    model = cfg.model
    if isinstance(model, GPTConfig):
        return GPTModule(model, cfg.optim, cfg.trainer.max_steps, init_seed=cfg.seed)
    if isinstance(model, HFModelConfig):
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_config(hf_config(model))
        return HFCausalLM(lm, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    module = model.build()
    if not isinstance(module, pl.LightningModule):
        raise ValueError(
            f"model._target_={model.target!r} built a {type(module).__name__}, not a LightningModule; point it at "
            "your LightningModule class."
        )
    return module


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
    """The transformers config of ``model=hf``: a built-in tiny one, or read from a local path (never downloaded)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("model=hf needs transformers; pip install 'lightning-dist[hf]'.") from None

    if model.config in TINY_CONFIGS:
        class_name, kwargs = TINY_CONFIGS[model.config]
        config = getattr(transformers, class_name)(**kwargs)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(model.config, local_files_only=True)
        except OSError as err:
            raise ValueError(
                f"model.config={model.config!r} is neither a built-in tiny config ({', '.join(TINY_CONFIGS)}) nor a "
                f"local transformers config ({str(err).splitlines()[0]}); give a directory holding config.json."
            ) from None
    _compat.set_attn_implementation(config, model.attn_implementation)
    return config


def vocab_and_length(model: Any) -> tuple[int | None, int | None]:
    """The model's vocabulary size and longest sequence, where its config says (``None`` for a user's module)."""
    if isinstance(model, GPTConfig):
        return model.vocab_size, model.max_seq_len
    if isinstance(model, HFModelConfig):
        config = hf_config(model)
        return config.vocab_size, getattr(config, "max_position_embeddings", None)
    return None, None
