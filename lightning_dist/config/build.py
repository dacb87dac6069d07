"""What a run trains and on what: the built-in GPT and data, a user's own classes, or a HuggingFace model; and the
strategy that lays it out.

The app's model and data come from ``cfg.model`` / ``cfg.data``: a :class:`~lightning_dist.models.gpt.GPTConfig` /
:class:`~lightning_dist.data.config.DataConfig` (the built-in options), a
:class:`~lightning_dist.config.schema.TargetConfig` (``model=custom`` / ``data=custom``: your LightningModule /
LightningDataModule, built by Hydra), or an :class:`~lightning_dist.config.schema.HFModelConfig` (``model=hf``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import Strategy

from lightning_dist.checkpoint.weights import is_hf_folder
from lightning_dist.config.pretrained import pretrained_folder
from lightning_dist.config.schema import HFModelConfig, TrainConfig
from lightning_dist.config.shapes import hf_config
from lightning_dist.config.shapes import planned_model as planned_model  # its home until plan/cli.py imports shapes
from lightning_dist.data import TokenDataModule
from lightning_dist.data.config import DataConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.hf import HFCausalLM
from lightning_dist.models.module import GPTModule
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies import DataParallelStrategy, MeshStrategy


def build_module(cfg: TrainConfig) -> pl.LightningModule:
    """The LightningModule of the run (built on every rank after seeding, so every rank starts from the same one)."""
    model, source = cfg.model, hf_source(cfg)
    if isinstance(model, GPTConfig):
        return GPTModule(model, cfg.optim, cfg.trainer.max_steps, init_seed=cfg.seed, hf_source=source)
    if isinstance(model, HFModelConfig):
        # Built in configure_model (on the meta device under our layouts); every weight is read after it when the
        # run starts from weights (init_from, which model.pretrained sets) or continues from a checkpoint.
        loaded = cfg.init_from is not None or cfg.ckpt_path is not None
        return HFCausalLM(
            hf_config(model),
            cfg.optim,
            cfg.trainer.max_steps,
            init_seed=cfg.seed,
            random_init=not loaded,
            hf_source=source,
            allow_untested_family=model.allow_untested_family,
            lora=model.lora,
        )
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


def build_strategy(cfg: TrainConfig, dims: ParallelDims) -> Strategy:
    """The strategy for ``parallelism.strategy``: Lightning's DDP (loader order kept) for ``ddp``, else our mesh
    strategy on ``dims``, whose path follows from the degrees alone; the run's guard, saving and process-group
    settings from ``resilience``, ``checkpoint`` and ``cluster``.

    ``fsdp`` is FSDP2 (torch ``fully_shard``) through the mesh strategy with ``tp=1``: Lightning's FSDPStrategy
    wraps the older FSDP1 and refuses to run on CPU.
    """
    timeout = timedelta(seconds=cfg.cluster.collective_timeout_s)
    backend, on_nonfinite = cfg.cluster.process_group_backend, cfg.resilience.on_nonfinite
    if cfg.parallelism.strategy == "ddp":
        return DataParallelStrategy(
            parallelism=cfg.parallelism, on_nonfinite=on_nonfinite, process_group_backend=backend, timeout=timeout
        )
    return MeshStrategy(
        parallel_dims=dims,
        parallelism=cfg.parallelism,
        on_nonfinite=on_nonfinite,
        async_save=cfg.checkpoint.async_save,
        process_group_backend=backend,
        timeout=timeout,
    )
