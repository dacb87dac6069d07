"""Fine-tuning's settings, checked before launch: ``model.lora`` (LoRA, QLoRA's device, peft installed),
``checkpoint.save_hf`` (a model whose HuggingFace names a sharded write can give) and ``eval.*`` (lm-eval tasks during
training, on each evaluated checkpoint's HuggingFace save). Torch-free: the launcher runs them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.models.lora_config import LoraConfig


@dataclass
class EvalConfig:
    """lm-evaluation-harness tasks run on the model during training (``eval.tasks=[hellaswag] eval.every_n_steps=500``),
    from each checkpoint's HuggingFace save (``checkpoint.save_hf=true``), logged as ``eval/<task>/<metric>``; after
    training: ``lightning-dist-eval RUN --tasks ...``."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (or of your include_path); [] = no evaluation during training."""
    every_n_steps: int | None = None
    """Evaluate the checkpoint of every step that is a multiple of this (a multiple of checkpoint.every_n_steps);
    None = checkpoint.every_n_steps."""
    limit: float | None = None
    """Examples per task (>= 1) or a fraction of each task (< 1); None = all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None = each task's default."""
    include_path: str | None = None
    """A folder of task YAML files of your own (a local dataset: dataset_path: json with data_files)."""
    batch_size: int = 8
    """lm-eval's batch size."""


def check_finetune(cfg: Any) -> None:
    """The rules below, for the run's config (a ``TrainConfig``); a user's own module has no ``model.lora``."""
    lora = getattr(cfg.model, "lora", None)
    if lora is not None:
        check_lora(lora, cfg.cluster.accelerator)
        if lora.enabled and cfg.parallelism.float8 != "off":
            # float8 would convert the frozen base layers and the adapters alike: not checked against one process.
            raise ValueError(
                f"model.lora with parallelism.float8={cfg.parallelism.float8}: float8 LoRA is not supported (it would "
                "convert the adapters too); set parallelism.float8=off."
            )
    if cfg.checkpoint.save_hf:
        check_save_hf(cfg.model)
    if cfg.eval.tasks:
        check_eval(cfg)


def check_lora(lora: LoraConfig, accelerator: str) -> None:
    """``model.lora``: its values, QLoRA's device, and peft installed (one line each)."""
    lora.check(accelerator)
    if lora.enabled and importlib.util.find_spec("peft") is None:
        raise ValueError(f"model.lora.rank={lora.rank} needs peft: pip install 'lightning-dist[hf]' (or set rank 0).")


def check_save_hf(model: Any) -> None:
    """``checkpoint.save_hf``: a model whose HuggingFace weights a sharded write can name (one line otherwise)."""
    if isinstance(model, GPTConfig) and model.arch != "llama":
        raise ValueError(
            f"checkpoint.save_hf=true with model.arch={model.arch}: its HuggingFace weights are fused from ours, which "
            "a sharded write cannot do; export them after the run (lightning-dist-export RUN OUT), or use arch=llama."
        )
    if not isinstance(model, GPTConfig) and getattr(model, "kind", None) != "hf":
        raise ValueError(
            "checkpoint.save_hf=true with your own LightningModule: it has no HuggingFace names; save them in your "
            "module, or set checkpoint.save_hf=false."
        )


def check_eval(cfg: Any) -> None:
    """``eval.*`` during training: lm-eval installed, a HuggingFace save at each evaluated step (one line each)."""
    every, saved = cfg.eval.every_n_steps or cfg.checkpoint.every_n_steps, cfg.checkpoint.every_n_steps
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"eval.tasks={cfg.eval.tasks} needs lm-eval: pip install 'lightning-dist[eval]'.")
    if not cfg.checkpoint.save_hf or not saved or every % saved:
        raise ValueError(
            f"eval.tasks={cfg.eval.tasks} evaluates each checkpoint's HuggingFace save: set checkpoint.save_hf=true "
            f"and checkpoint.every_n_steps to a divisor of eval.every_n_steps ({every})."
        )
    if not cfg.trainer.enable_checkpointing:
        raise ValueError("eval.tasks needs the run's checkpoints: set trainer.enable_checkpointing=true.")
