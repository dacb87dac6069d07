"""Preemption and shutdown at a step boundary: a signal only sets a flag, a collective decides (Megatron's way).

SIGTERM (a scheduler's preemption, ``kill``), SIGUSR1 / SIGUSR2 (SLURM's ``--signal=USR1@<s>``; submitit asks for
USR2) and SIGINT (Ctrl-C) set a flag on the rank that got it. After every optimizer step each rank starts a tiny
non-blocking all-reduce (max) of its flag and reads the one it started a step earlier, which has long finished: the
host never waits for the device or its peers to agree, and every rank reads the same agreed value after the same
step, so they all stop together, at most one step after the signal (a step is seconds; SLURM's warning is minutes).
On CUDA the agreed flag is copied to pinned host memory as soon as the collective is done and read from there. The
run's checkpoint callback then saves that step, and the job exits with :data:`PREEMPTED_EXIT_CODE`. A second Ctrl-C
on a rank raises ``KeyboardInterrupt`` at once (no save).
"""

from __future__ import annotations

import signal
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dist import _compat
from lightning_dist.errors import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE  # re-exported (its old home)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class Preemption(pl.Callback):
    """Stops training after the first optimizer step at which any rank has received one of :data:`SIGNALS`."""

    def __init__(self) -> None:
        self.received: int = 0  # the signal this rank got (0: none)
        self.agreed: int = 0  # the signal all ranks stopped for
        self._previous: dict[int, Any] = {}
        self._last_step = -1
        self._pending: _Agreement | None = None  # the all-reduce started after the previous optimizer step
        self._undo_sigterm_check = lambda: None

    @property
    def signal_name(self) -> str | None:
        """The name of the signal the run stopped for, or ``None``."""
        return signal.Signals(self.agreed).name if self.agreed else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        # Lightning's own per-batch SIGTERM broadcast (a blocking collective and a host read) can only ever send
        # "no" now that our handler has replaced Lightning's: this agreement does its job.
        self._undo_sigterm_check = _compat.skip_sigterm_broadcast(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:  # every rank started it: finish it before any later collective
            self._pending.value()
            self._pending = None
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._last_step:
            return  # a gradient-accumulation micro batch: stop only at an optimizer step
        self._last_step = trainer.global_step
        agreed = self._pending.value() if self._pending is not None else 0
        self._pending = _Agreement(self.received, trainer.strategy.root_device)
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
        self._undo_sigterm_check()
        self._undo_sigterm_check = lambda: None


class _Agreement:
    """The maximum of every rank's flag, reduced in the background: started now, read after the next step."""

    def __init__(self, flag: int, device: torch.device) -> None:
        # A fill, not torch.tensor([flag]): that copies host memory to the device, which blocks the host on CUDA.
        self._flag = torch.full((1,), flag, dtype=torch.int32, device=device)
        self._work = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        self._host, self._copied = self._flag, None
        if device.type == "cuda":  # copied to pinned memory on the stream, behind the collective: no host wait
            if self._work is not None:
                self._work.wait()  # orders the copy after the collective on the current stream; the host goes on
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self._flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def value(self) -> int:
        """The agreed flag; the collective (and copy) started a step ago have finished by now in practice."""
        if self._copied is not None:
            self._copied.synchronize()
        elif self._work is not None:
            self._work.wait()
        return int(self._host[0])
