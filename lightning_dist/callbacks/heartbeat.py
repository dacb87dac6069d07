"""Heartbeats: each rank says after its optimizer steps how long its launcher may wait for the next one.

A rank that stops making progress (a frozen process, a deadlock in a collective) would otherwise hold the job until
the collective timeout (10 minutes). Each rank writes its step and an allowed silence to a file the launcher gave it
(``LIGHTNING_DIST_HEARTBEAT``; the file's format and the functions that write and read it are
:mod:`lightning_dist.callbacks.beat_file`, which the launcher imports without Lightning); the launcher ends the job
when a file is older than the silence it allows (:func:`lightning_dist.run.launch.launch`). The allowance is
``hang_timeout_s`` when set, else ``factor`` times the slowest step seen so far with a floor; the first steps
(compilation, warm-up), validation, checkpoint saves and the end of training (final save, teardown) are allowed
``busy_s``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

from lightning_dist.callbacks.beat_file import BUSY_S, beat, busy_until

# Re-exported (heartbeat.ENV, .busy, .read: their first home); the launcher imports beat_file, without Lightning.
from lightning_dist.callbacks.beat_file import ENV as ENV
from lightning_dist.callbacks.beat_file import busy as busy
from lightning_dist.callbacks.beat_file import read as read


class Heartbeat(pl.Callback):
    """Beats after optimizer steps, at most once per ``interval_s`` unless the allowance changed (module docstring).

    Args:
        timeout_s: The allowed silence between steps; ``None`` = ``factor`` x the slowest step, at least ``floor_s``.
        floor_s: The smallest automatic allowance.
        factor: Automatic allowance as a multiple of the slowest step so far.
        warmup_steps: Steps after the start that are allowed ``busy_s`` (compilation, allocator warm-up).
        busy_s: The allowance for the first steps, validation, saves and the end of training.
        interval_s: The shortest time between two beats of steady steps (a beat is a file write).
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        floor_s: float = 60.0,
        factor: float = 5.0,
        warmup_steps: int = 2,
        busy_s: float = BUSY_S,
        interval_s: float = 1.0,
    ) -> None:
        self.timeout_s, self.floor_s, self.factor = timeout_s, floor_s, factor
        self.warmup_steps, self.busy_s, self.interval_s = warmup_steps, busy_s, interval_s
        self._start_step, self._last_step, self._last_time, self._slowest = 0, -1, 0.0, 0.0
        self._last_beat, self._last_allowed = 0.0, busy_s

    def _beat(self, step: int, allowed_s: float) -> None:
        beat(step, allowed_s)
        self._last_beat, self._last_allowed = time.monotonic(), allowed_s

    @property
    def allowed_s(self) -> float:
        """The silence allowed after a step, as the run now stands."""
        if self.timeout_s is not None:
            return self.timeout_s
        return max(self.floor_s, self.factor * self._slowest)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = self._last_step = trainer.global_step
        self._last_time = time.monotonic()
        self._beat(trainer.global_step, self.busy_s)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a gradient-accumulation micro batch
        now = time.monotonic()
        if step - self._start_step > 1:  # the first step's time is compilation and warm-up, not a step
            since = max(self._last_time, busy_until())  # a save in between is not step time
            self._slowest = max(self._slowest, (now - since) / (step - self._last_step))
        self._last_step, self._last_time = step, now
        warming_up = step - self._start_step < self.warmup_steps
        allowed = max(self.allowed_s, self.busy_s) if warming_up else self.allowed_s
        # A file write per step costs ~0.4 ms of host time; the launcher needs a beat per few seconds at most (the
        # allowance is a minute or more), so steady steps beat once a second, a changed allowance at once.
        if now - self._last_beat >= self.interval_s or not 0.9 <= allowed / self._last_allowed <= 1.1:
            self._beat(step, allowed)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._beat(trainer.global_step, self.busy_s)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._last_time = time.monotonic()  # validation time is not a step's
            self._beat(trainer.global_step, self.allowed_s)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._beat(trainer.global_step, self.busy_s)  # the final save, loggers and teardown
