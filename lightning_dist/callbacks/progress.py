"""A progress bar that shows the training loss without reading it back after every batch.

Lightning turns every value logged with ``prog_bar=True`` into a Python number after every batch
(``_ResultCollection.metrics`` calls ``.item()``), whether a bar is shown or not and whether the value is new or the
one logged steps ago: on a GPU, a device sync per step. The built-in modules therefore log ``train/loss`` without
``prog_bar``, and this bar reads it once per logging step (``trainer.log_every_n_steps``) instead.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_dist import _compat


class LoggedLossBar(TQDMProgressBar):
    """Lightning's TQDM bar, plus the value of ``key`` as of the last logging step.

    Args:
        key: The logged metric to show (a key of ``trainer.callback_metrics``).
        refresh_rate: Batches between two redraws of the bar (as for ``TQDMProgressBar``).
    """

    def __init__(self, key: str = "train/loss", refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.key = key
        self._value: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if _compat.logs_this_step(trainer):
            value = trainer.callback_metrics.get(self.key)
            if value is not None:
                self._value = float(value)  # one read, on a logging step
        super().on_train_batch_end(trainer, pl_module, *args)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if self._value is not None:
            metrics[self.key] = f"{self._value:.4g}"
        return metrics
