"""Preemption and shutdown at a step boundary: a signal only sets a flag, a collective decides (Megatron's way).

SIGTERM (a scheduler's preemption, ``kill``), SIGUSR1 / SIGUSR2 (SLURM's ``--signal=USR1@<s>``; submitit asks for
USR2) and SIGINT (Ctrl-C) set a flag
on the rank that got it. After every optimizer step the ranks take the maximum of their flags (one tiny all-reduce),
so they all stop after the same step; the run's checkpoint callback then saves that step, and the job exits with
:data:`PREEMPTED_EXIT_CODE`. A second Ctrl-C on a rank raises ``KeyboardInterrupt`` at once (no save).
"""

from __future__ import annotations

import signal
from typing import Any

import lightning.pytorch as pl
import torch

#: A job's exit code after it stopped for a signal and saved (EX_TEMPFAIL, "try again": a wrapper may requeue it).
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class Preemption(pl.Callback):
    """Stops training after the first optimizer step at which any rank has received one of :data:`SIGNALS`."""

    def __init__(self) -> None:
        self.received: int = 0  # the signal this rank got (0: none)
        self.agreed: int = 0  # the signal all ranks stopped for
        self._previous: dict[int, Any] = {}
        self._last_step = -1

    @property
    def signal_name(self) -> str | None:
        """The name of the signal the run stopped for, or ``None``."""
        return signal.Signals(self.agreed).name if self.agreed else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._last_step:
            return  # a gradient-accumulation micro batch: stop only at an optimizer step
        self._last_step = trainer.global_step
        flag = torch.tensor(self.received, dtype=torch.int32, device=trainer.strategy.root_device)
        agreed = int(trainer.strategy.reduce(flag, reduce_op="max"))
        if agreed:
            self.agreed = agreed
            trainer.should_stop = True  # the checkpoint callback saves this step when training ends

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.received = self.received or signum

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
