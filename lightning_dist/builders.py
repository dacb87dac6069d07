"""What a run trains and on what: the built-in GPT and data, a user's own classes, or a HuggingFace model.

The app's model and data come from ``cfg.model`` / ``cfg.data``: a :class:`~lightning_dist.models.gpt.GPTConfig` /
:class:`~lightning_dist.data.config.DataConfig` (the built-in options), a :class:`~lightning_dist.config.TargetConfig`
(``model=custom`` / ``data=custom``: your LightningModule / LightningDataModule, built by Hydra), or an
:class:`~lightning_dist.config.HFModelConfig` (``model=hf``). The checks here run before any process starts.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_dist.config import HFModelConfig, TargetConfig, TrainConfig
from lightning_dist.data.config import DataConfig, validate_data_config
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel_dims import ParallelDims


def check_model_and_data(cfg: TrainConfig, dims: ParallelDims) -> int | None:
    """Check the model and data against each other and the layout; return the per-rank batch when it is known."""
    from lightning_dist.data import TokenDataModule

    model, data = cfg.model, cfg.data
    for group, node in (("model", model), ("data", data)):
        if isinstance(node, TargetConfig):
            _check_importable(group, node.target)
    if isinstance(model, GPTConfig):
        model.validate()
    vocab, max_len = _vocab_and_length(model)
    if not isinstance(data, DataConfig):
        return None  # a user's DataModule: its loaders give per-rank batches (the global batch is dp x that)
    per_rank_batch = TokenDataModule.per_rank_batch_size(data.global_batch_size, dims.dp_size)
    if vocab is not None and data.vocab_size > vocab:
        raise ValueError(
            f"data.vocab_size={data.vocab_size} exceeds the model's vocabulary of {vocab}; "
            f"set model.vocab_size>={data.vocab_size} (or use a model with a larger vocabulary)."
        )
    if max_len is not None and data.seq_len > max_len:
        raise ValueError(
            f"data.seq_len={data.seq_len} exceeds model.max_seq_len={max_len}; "
            f"lower data.seq_len or raise model.max_seq_len."
        )
    validate_data_config(data)
    datamodule = TokenDataModule(data, seed=cfg.seed)
    datamodule.setup()  # missing / empty / binary-as-text files fail here, before any rank starts
    if data.kind == "tokens":
        for split in ("train", "val"):
            dataset = datamodule.dataset(split)
            largest = dataset.max_token()
            if largest >= data.vocab_size:
                raise ValueError(
                    f"{str(dataset.file)!r} holds token id {largest}, beyond data.vocab_size={data.vocab_size}; set "
                    f"data.vocab_size (and model.vocab_size) above {largest}, or check data.token_dtype."
                )
    return per_rank_batch


def resolve_micro_batch(cfg: TrainConfig, dims: ParallelDims, per_rank_batch: int | None) -> None:
    """Settle how each rank's batch is split: ``trainer.accumulate_grad_batches`` and, under pp, the microbatches.

    Without pp, the per-rank batch runs as ``per_rank / micro_batch_size`` forwards whose gradients Lightning
    accumulates (synced on the last one). Under pp the micro batches are the pipeline's microbatches, all run by the
    schedule in one training step (as Megatron does): accumulation is what a pipeline does already.
    """
    par, accumulate = cfg.parallelism, cfg.trainer.accumulate_grad_batches
    if accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate} must be >= 1.")
    if per_rank_batch is None:  # a user's DataModule: its loader's batch is the micro batch
        if dims.pp_enabled and accumulate > 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate} with parallelism.pp={dims.pp}: a pipeline accumulates "
                f"over its microbatches; make your loader's batch {accumulate}x larger and set "
                f"parallelism.microbatches to the number of micro batches it holds."
            )
        return
    data, micro = cfg.data, cfg.data.micro_batch_size
    where = f"the per-rank batch {per_rank_batch} (data.global_batch_size={data.global_batch_size} / dp={dims.dp_size})"
    if micro is None:
        if per_rank_batch % accumulate:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate} does not divide {where}; use a divisor of it."
            )
        if accumulate == 1:
            return  # one forward per rank and step
        micro = data.micro_batch_size = per_rank_batch // accumulate
    if per_rank_batch % micro:
        raise ValueError(f"data.micro_batch_size={micro} does not divide {where}; use a divisor of it.")
    steps = per_rank_batch // micro
    if accumulate not in (1, steps):
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate} contradicts data.micro_batch_size={micro} ({where} is "
            f"{steps} micro batches); set only data.micro_batch_size."
        )
    if not dims.pp_enabled:
        cfg.trainer.accumulate_grad_batches = steps
        return
    if par.microbatches is not None and par.microbatches != steps:
        raise ValueError(
            f"parallelism.microbatches={par.microbatches} contradicts data.micro_batch_size={micro} ({where} is "
            f"{steps} micro batches); set only one of them."
        )
    par.microbatches, cfg.trainer.accumulate_grad_batches = steps, 1


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
        from lightning_dist.models.module import GPTModule

        return GPTModule(model, cfg.optim, cfg.trainer.max_steps, init_seed=cfg.seed)
    if isinstance(model, HFModelConfig):
        from transformers import AutoModelForCausalLM

        from lightning_dist.models.hf import HFCausalLM

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
        from lightning_dist.data import TokenDataModule

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
    from lightning_dist.models.hf import TINY_CONFIGS

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
    config._attn_implementation = model.attn_implementation
    return config


def _vocab_and_length(model: Any) -> tuple[int | None, int | None]:
    if isinstance(model, GPTConfig):
        return model.vocab_size, model.max_seq_len
    if isinstance(model, HFModelConfig):
        config = hf_config(model)
        return config.vocab_size, getattr(config, "max_position_embeddings", None)
    return None, None


def _check_importable(group: str, target: str) -> None:
    from hydra.utils import get_class

    try:
        get_class(target)
    except Exception as err:  # Hydra wraps the import error; its first line names the cause
        raise ValueError(
            f"{group}._target_={target!r} cannot be imported ({str(err).splitlines()[0]}); give the full import path "
            "of your class (package.module.Class) and make sure its package is installed or on PYTHONPATH."
        ) from None
