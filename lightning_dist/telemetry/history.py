"""Per-step record of the logged training loss (what the app returns and the layout tests compare); the app adds
the telemetry's throughput, time split and memory to the steps where it logged them (:func:`merge_telemetry`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_dist.parallel_dims import REPORTED_AXES

#: Telemetry values copied into the records of the steps where the telemetry logged (every few steps).
TELEMETRY_KEYS = ("perf/tokens_per_sec", "perf/tokens_per_sec_per_device", "perf/step_ms", "perf/data_ms", "perf/mfu",
                  "memory/rss_gib", "memory/peak_allocated_gib", "comm/fraction",
                  *(f"comm/{axis}/ms" for axis in REPORTED_AXES), "pipeline/bubble_fraction",
                  "memory/params_gib", "memory/grads_gib", "memory/optimizer_gib",
                  *(f"comm/{axis}/{kind}" for axis in (*REPORTED_AXES, "world")
                    for kind in ("bytes", "calls")))  # fmt: skip


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


def merge_telemetry(records: list[dict[str, float]], telemetry: list[dict[str, float]]) -> None:
    """Add the :data:`TELEMETRY_KEYS` of each telemetry record to the loss record of the same step, in place."""
    by_step = {int(r["step"]): r for r in telemetry}
    for record in records:
        logged = by_step.get(int(record["step"]), {})
        record.update({key: float(logged[key]) for key in TELEMETRY_KEYS if key in logged})
