"""Evaluation on lm-evaluation-harness: a run's model on chosen tasks, after training or every N steps during it.

:func:`evaluate` runs lm-eval's HuggingFace backend (``lm_eval.simple_evaluate(model="hf", ...)``) over a
:class:`~lightning_dist.checkpoint.hf_model.HFModel` (an exported or ``checkpoint.save_hf`` folder, with its peft
adapter for a LoRA run) and returns the metrics as ``eval/<task>/<metric>`` (lm-eval's ``acc,none`` becomes ``acc``;
a filter other than ``none`` is kept: ``exact_match_strict-match``; standard errors are left out). Tasks are lm-eval's
own names, or tasks of your own from YAML files in ``include_path`` (a local ``dataset_path: json`` with
``dataset_kwargs.data_files`` needs no network).

:class:`EvalCallback` does it during training: after each checkpoint a ``RunCheckpoints(save_hf=True)`` published at a
step that is a multiple of ``every_n_steps``, rank 0 evaluates that checkpoint's ``hf/`` folder and logs the metrics at
that step to the trainer's loggers. A checkpoint is published at the step boundary after its save (once that step's
metrics are logged), so it is evaluated there: at the next batch's start, or at the end of training. Every rank
decides from the same data (the trainer's step and the last step evaluated, which each rank notes), and rank 0's
outcome (the metrics, or its one-line error) is broadcast to all: they enter the same collectives, and fail together
with the same error.

Needs lm-eval (``lightning-dist[eval]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_dist.callbacks import beat_file
from lightning_dist.checkpoint.hf_model import HFModel, load_hf_model, resolve_hf_model
from lightning_dist.checkpoint.hf_save import HF_FOLDER
from lightning_dist.errors import first_line


def evaluate(
    model: HFModel,
    tasks: Sequence[str],
    *,
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = 8,
    device: str | None = None,
    dtype: str = "auto",
    results: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``model`` on lm-eval's ``tasks``: ``{"eval/<task>/<metric>": value}``.

    Args:
        model: The folder (and adapter) to load.
        tasks: lm-eval task names (or group names), or names defined by YAML files in ``include_path``.
        include_path: A folder of task YAML files of your own.
        limit: Examples per task (an int) or a fraction of each task; ``None`` = all.
        num_fewshot: Few-shot examples per prompt; ``None`` = each task's default.
        batch_size: lm-eval's batch size (``"auto"`` finds the largest that fits).
        device: ``cuda``, ``cuda:1``, ``cpu``; ``None`` = ``cuda`` where there is one.
        dtype: The weights' dtype when loaded (``auto``: the folder's ``torch_dtype``; ``bfloat16``, ``float32``).
        results: Filled with lm-eval's whole result (samples left out), for a caller that writes it.

    Raises:
        ValueError: A task lm-eval does not know (one line naming it and the include path), or a task whose data
            cannot be loaded (no network: one line).
    """
    import lm_eval  # optional dependency: lightning-dist[eval]
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else " (give --include-path for tasks of your own)"
        raise ValueError(f"lm-eval has no task {unknown[0]!r}{where}; list them with `lm-eval ls tasks`.")
    from lm_eval.models.huggingface import HFLM

    # The model is loaded here and handed to lm-eval's HF backend built: given an adapter (its peft= argument),
    # lm-eval resizes the embedding to the tokenizer's length first, which for a model whose vocabulary is padded
    # past its tokenizer's (Qwen, Llama-style rounding) changes every log-likelihood.
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tokenizer = load_hf_model(model, device, dtype)
    try:
        out = lm_eval.simple_evaluate(
            model=HFLM(pretrained=net, tokenizer=tokenizer, batch_size=batch_size),
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=0,
        )
    except OSError as err:  # datasets' ConnectionError / DatasetNotFoundError, huggingface_hub's HTTP errors
        raise ValueError(
            f"the data of {' '.join(tasks)} could not be loaded ({first_line(err)}); without network, evaluate on "
            "tasks whose data is local (a task YAML with dataset_path: json in --include-path / eval.include_path) "
            "or on a datasets cache filled beforehand."
        ) from err
    if results is not None:
        results.update({k: v for k, v in out.items() if k != "samples"})
    return metrics_of(out["results"])


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's per-task results as ``eval/<task>/<metric>`` floats (see the module docstring)."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            name, _, kind = key.partition(",")
            if not kind or "_stderr" in name or not isinstance(value, (int, float)):
                continue
            metrics[f"eval/{task}/{name if kind == 'none' else f'{name}_{kind}'}"] = float(value)
    return metrics


class EvalCallback(pl.Callback):
    """Evaluate lm-eval ``tasks`` on the run's HuggingFace save every ``every_n_steps`` (see the module docstring).

    Put it after the run's ``RunCheckpoints(save_hf=True)`` (checkpoint.save_hf), saving at least as often.

    Args:
        checkpoints: The run's checkpoint folder (``<run>/checkpoints``).
        tasks: lm-eval task names.
        every_n_steps: Evaluate the checkpoint of every step that is a multiple of this.
        include_path, limit, num_fewshot, batch_size: As for :func:`evaluate`.
    """

    def __init__(
        self,
        checkpoints: Path,
        tasks: Sequence[str],
        every_n_steps: int,
        *,
        include_path: str | Path | None = None,
        limit: int | float | None = None,
        num_fewshot: int | None = None,
        batch_size: int | str = 8,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"EvalCallback(every_n_steps={every_n_steps}) must be >= 1.")
        self.checkpoints, self.tasks, self.every_n_steps = Path(checkpoints), list(tasks), every_n_steps
        self.options = {
            "include_path": include_path,
            "limit": limit,
            "num_fewshot": num_fewshot,
            "batch_size": batch_size,
        }
        self.history: list[dict[str, float]] = []  #: each evaluation's metrics with its ``step`` (every rank's)
        self._last_step = -1  # the step evaluated last, noted by every rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run's checkpoint was evaluated by the run that saved it

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._due(trainer.global_step):  # the step just done: its checkpoint is published at this boundary
            self._evaluate(trainer, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer.global_step):  # the final checkpoint (saved at the end of training), if not evaluated yet
            self._evaluate(trainer, trainer.global_step)

    def _due(self, step: int) -> bool:
        """Whether ``step`` is evaluated: the same answer on every rank (the step and the last one evaluated are every
        rank's own, never rank 0's alone), so the ranks meet in the same collectives."""
        return step > 0 and step % self.every_n_steps == 0 and step != self._last_step

    def _evaluate(self, trainer: pl.Trainer, step: int) -> None:
        self._last_step = step
        outcome: dict[str, float] | str | None = None
        failed: Exception | None = None
        with beat_file.busy(step):  # minutes, maybe: the launcher must not take it for a hang
            if trainer.is_global_zero:
                try:
                    outcome = self._metrics(trainer, step)
                except Exception as err:  # said to every rank: the others must not wait for rank 0 forever
                    failed, outcome = err, f"EvalCallback at step {step}: {first_line(err)}"
            outcome = trainer.strategy.broadcast(outcome, src=0)
        if isinstance(outcome, str):  # every rank the same line; rank 0's with its own exception's traceback
            raise ValueError(outcome) from failed
        self.history.append({"step": step, **outcome})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(outcome, step=step)

    def _metrics(self, trainer: pl.Trainer, step: int) -> dict[str, float]:
        """Rank 0: the metrics of the checkpoint of ``step``."""
        folder = self.checkpoints / f"step-{step:08d}" / HF_FOLDER
        if not folder.is_dir():
            raise ValueError(
                f"no HuggingFace save at {folder}; set checkpoint.save_hf=true and save every {self.every_n_steps} "
                "steps (checkpoint.every_n_steps)."
            )
        device = str(trainer.strategy.root_device) if trainer.strategy.root_device.type == "cuda" else "cpu"
        return evaluate(resolve_hf_model(folder), self.tasks, device=device, **self.options)
