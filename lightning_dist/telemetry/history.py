"""Per-step record of the logged training loss (what the app returns and the layout tests compare); the app adds
the telemetry's throughput, time split and memory to the steps where it logged them (:func:`merge_telemetry`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_dist import _compat
from lightning_dist.parallel.replicas import REPLICA_KEYS
from lightning_dist.parallel_dims import REPORTED_AXES
from lightning_dist.telemetry.comm import OUTER_AXIS
from lightning_dist.telemetry.outer import DILOCO_KEYS

#: Telemetry values copied into the records of the steps where the telemetry logged (every few steps).
TELEMETRY_KEYS = (
    "perf/tokens_per_sec",
    "perf/tokens_per_sec_per_device",
    "perf/step_ms",
    "perf/data_ms",
    "perf/mfu",
    "memory/rss_gib",
    "memory/peak_allocated_gib",
    "comm/fraction",
    *(f"comm/{axis}/ms" for axis in REPORTED_AXES),
    "pipeline/bubble_fraction",
    "memory/params_gib",
    "memory/grads_gib",
    "memory/optimizer_gib",
    *(f"comm/{axis}/{kind}" for axis in (*REPORTED_AXES, OUTER_AXIS, "world") for kind in ("bytes", "calls")),
    *DILOCO_KEYS,
    *REPLICA_KEYS,
)


class LossHistory(pl.Callback):
    """Keeps the training loss of every optimizer step (and ``train/grad_norm`` where logged), as floats.

    The loss of a step is the global mean of what ``training_step`` returned (Lightning's ``outputs["loss"]``,
    summed over the step's micro batches): the value the built-in modules log as ``train/loss`` with ``sync_dist``.
    Nothing is read per step: each step's loss stays on the device, and on logging steps
    (:func:`lightning_dist._compat.logs_this_step`) and at the end of training the steps since the last read are
    averaged over the ranks in one all-reduce and read in one copy. ``train/grad_norm`` is what the strategy logged,
    on those steps. A module whose ``training_step`` returns no loss gets the logged ``train/loss`` of those steps.
    """

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self._last_step = 0
        self._micro: Tensor | None = None  # this step's loss so far (the sum of its micro batches' shares)
        self._pending: list[tuple[int, Tensor | None]] = []  # steps not read yet: (step, loss on the device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            if hasattr(loss, "full_tensor"):  # replicated under loss parallelism: no communication
                loss = loss.full_tensor()
            loss = loss.detach().float().reshape(())  # Lightning divided it by the accumulation: shares add up
            self._micro = loss if self._micro is None else self._micro + loss
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: a micro batch, no optimizer step yet
        self._last_step = trainer.global_step
        self._pending.append((trainer.global_step, self._micro))
        self._micro = None
        if _compat.logs_this_step(trainer):
            self._read(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read(trainer)

    def _read(self, trainer: pl.Trainer) -> None:
        """Reduce and read the pending steps' losses (one collective, one device-to-host copy)."""
        if not self._pending:
            return
        metrics = trainer.callback_metrics  # this step's logged (reduced) values
        steps = [step for step, _ in self._pending]
        if all(loss is not None for _, loss in self._pending):
            stacked = torch.stack([loss for _, loss in self._pending])
            losses = trainer.strategy.reduce(stacked, reduce_op="mean").tolist()  # the mean over every rank
        else:  # training_step returned no loss: what was logged, on this step only
            logged = metrics.get("train/loss")
            losses = [None] * (len(steps) - 1) + [float(logged) if logged is not None else None]
        self._pending = []
        for step, loss in zip(steps, losses, strict=True):
            record = {"step": float(step)}
            if loss is not None:
                record["train/loss"] = loss
            self.records.append(record)
        if "train/grad_norm" in metrics and self.records[-1]["step"] == trainer.global_step:
            self.records[-1]["train/grad_norm"] = float(metrics["train/grad_norm"])


def merge_telemetry(records: list[dict[str, float]], telemetry: list[dict[str, float]]) -> None:
    """Add the :data:`TELEMETRY_KEYS` of each telemetry record to the loss record of the same step, in place."""
    by_step = {int(r["step"]): r for r in telemetry}
    for record in records:
        logged = by_step.get(int(record["step"]), {})
        record.update({key: float(logged[key]) for key in TELEMETRY_KEYS if key in logged})
