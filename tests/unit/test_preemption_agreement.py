"""The preemption flag is agreed without a host wait in the step: each optimizer step starts a non-blocking
all-reduce and reads the one started a step earlier, so every rank stops after the same step, one step after the
signal."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import torch

from lightning_dist.callbacks.preemption import Preemption


def _trainer() -> SimpleNamespace:
    return SimpleNamespace(global_step=0, should_stop=False, strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_a_signal_stops_training_one_optimizer_step_later() -> None:
    callback, trainer = Preemption(), _trainer()
    stopped_after = []
    for step in range(1, 6):
        if step == 2:
            callback._handle(signal.SIGTERM, None)  # arrives during step 2
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None)
        if trainer.should_stop:
            stopped_after.append(step)
            break
    # Step 2's flag is started after step 2 and read after step 3: the ranks stop together, one step late.
    assert stopped_after == [3]
    assert callback.signal_name == "SIGTERM"


def test_micro_batches_of_one_step_neither_start_nor_read_an_agreement() -> None:
    callback, trainer = Preemption(), _trainer()
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, None)
    pending = callback._pending
    callback.on_train_batch_end(trainer, None)  # an accumulating micro batch: same optimizer step
    assert callback._pending is pending
