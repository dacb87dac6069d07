"""Per-step record of the logged training loss (what the app returns and the layout tests compare)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class LossHistory(pl.Callback):
    """Keeps ``train/loss`` (and ``train/grad_norm`` when logged) of every optimizer step, as floats.

    The values are read from what the module logged, after Lightning's reduction (``sync_dist``), so under any
    layout they are the global-batch values.
    """

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self._last_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: a micro batch, no optimizer step yet
        self._last_step = trainer.global_step
        metrics = trainer.callback_metrics  # computed on access from this step's logged (reduced) values
        record = {"step": float(trainer.global_step)}
        for key in ("train/loss", "train/grad_norm"):
            if key in metrics:
                record[key] = float(metrics[key])
        self.records.append(record)
