"""Shared test helpers: compose the real config (forced onto CPU), run a layout, compare with one process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from lightning_dist.config.schema import TrainConfig, register_configs, to_train_config

CONF_DIR = Path(__file__).resolve().parents[1] / "lightning_dist" / "conf"

#: A run small enough for a 2-core machine: 2-layer, 64-wide GPT, 8 x 32-token batches, no validation, no files.
FAST = [
    "logger=none",
    "trainer.enable_checkpointing=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "data.global_batch_size=8",
    "data.seq_len=32",
    "data.num_train_samples=512",
    "data.num_val_samples=64",
    "model.max_seq_len=64",
    "telemetry.report=false",
]


_OURS: list = []  # the Hydra instance compose_config initialized, kept between calls (initializing costs ~60 ms)


def compose_config(overrides: list[str], output_dir: Path | str | None = None) -> TrainConfig:
    """The typed config that ``lightning-dist-train <overrides>`` would run."""
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    hydra = GlobalHydra.instance()
    if not hydra.is_initialized() or not _OURS or hydra.hydra is not _OURS[0]:
        hydra.clear()  # someone else's (an in-process hydra.main) or none
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")  # initializes on construction
        _OURS[:] = [hydra.hydra]
    cfg = compose(config_name="train", overrides=overrides)
    train_cfg: TrainConfig = to_train_config(cfg)
    if output_dir is not None:
        train_cfg.output_dir = str(output_dir)
    return train_cfg


def run_app(overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """Run the training app in-process (it spawns the ranks) and return rank 0's summary."""
    from lightning_dist.run.train import run

    return run(compose_config(overrides, output_dir))


def losses(result: dict[str, Any], key: str = "train/loss") -> list[float]:
    return [record[key] for record in result["history"]]


class GradNorms:
    """A Lightning callback recording the global gradient norm of every optimizer step.

    Our strategies log it (``train/grad_norm``, over every axis); elsewhere (Lightning's own strategies: whole
    gradients on every rank) it is computed here, before the optimizer step.
    """

    def __new__(cls):  # a pl.Callback built lazily, so this module imports without Lightning
        import lightning.pytorch as pl
        import torch

        from lightning_dist import MeshStrategy
        from lightning_dist.strategies import DataParallelStrategy

        class _GradNorms(pl.Callback):
            def __init__(self) -> None:
                self.values: list[float] = []
                self._local: float | None = None

            def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
                if not isinstance(trainer.strategy, (MeshStrategy, DataParallelStrategy)):
                    grads = [p.grad.detach().float().norm() for p in pl_module.parameters() if p.grad is not None]
                    self._local = float(torch.linalg.vector_norm(torch.stack(grads)))

            def on_train_batch_end(self, trainer, *args) -> None:
                local, self._local = self._local, None
                self.values.append(local if local is not None else float(trainer.callback_metrics["train/grad_norm"]))

        return _GradNorms()


def quiet_trainer(strategy, devices: int, max_steps: int, callbacks=(), **kwargs):
    """A CPU ``Trainer`` with Lightning's defaults except the outputs a test does not read (logger, checkpoints,
    progress bar, model summary)."""
    import lightning.pytorch as pl

    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    # The tests read every step's train/loss and train/grad_norm, which the built-in modules and our strategies log
    # on logging steps only (no host read in the steps between).
    kwargs.setdefault("log_every_n_steps", 1)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def assert_planned(result: dict[str, Any]) -> None:
    """The planner's per-step collectives of rank 0 are exactly what the telemetry measured (bytes and calls per
    axis), and its parameter + optimizer bytes of the largest rank are within 5% of what the ranks held."""
    prediction = result["prediction"]
    for kind in ("bytes", "calls"):
        predicted, measured = prediction[f"communication {kind} per step, rank 0"]
        if predicted is not None:  # None: a layout the planner states it does not model (pp=1 virtual stages)
            assert predicted == (measured or {}), f"{kind}: planned {predicted}, measured {measured}"
    predicted, measured = prediction["parameters + optimizer state GiB, largest rank"]
    assert predicted == pytest.approx(measured, rel=0.05)


#: A chat template for :func:`make_tiny_tokenizer`: ``<|role|>content<|end|>`` per message.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_tokenizer(
    folder: Path, vocab_texts: list[str], vocab_size: int = 300, chat_template: str | None = TINY_CHAT_TEMPLATE
) -> Path:
    """A byte-level BPE tokenizer trained offline on ``vocab_texts`` (at most ``vocab_size`` tokens, EOS
    ``<|endoftext|>``; with ``chat_template``, also ``<|user|>``, ``<|assistant|>``, ``<|system|>``, ``<|end|>``),
    saved to ``folder`` as a HuggingFace tokenizer folder (``AutoTokenizer.from_pretrained(folder)``). Returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>"] + (["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"] if chat_template else [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(vocab_texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return Path(folder)


def write_instruction_jsonl(path: Path, n: int, prompt_field: str = "prompt", response_field: str = "response") -> Path:
    """``n`` prompt / response records as JSON lines (record ``i`` asks for ``i + i``). Returns ``path``."""
    import json

    lines = [
        json.dumps({prompt_field: f"question {i}: what is {i} plus {i}?", response_field: f" the answer is {2 * i}."})
        for i in range(n)
    ]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


#: What a launcher (ours, torchrun, SLURM, submitit, Lightning's own) leaves in os.environ. Another test in the same
#: pytest worker may have left them (Lightning writes MASTER_ADDR / MASTER_PORT itself), and a child process that
#: inherits them waits for ranks or an address that never come.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SUBMITIT_EXECUTOR",
               "LIGHTNING_DIST_LAUNCHER_PID", "LIGHTNING_DIST_HEARTBEAT")  # fmt: skip


def fresh_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without any launcher's variables (and no ``SLURM_*``), plus ``extra``: for a child process
    that must start a job of its own."""
    return {
        **{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")},
        **extra,
    }
