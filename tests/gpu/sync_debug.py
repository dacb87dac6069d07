"""CUDA's sync debug mode on the steps that do not log: a host synchronization there raises."""

from __future__ import annotations


class NoSyncBetweenQuietSteps:
    """Turns ``torch.cuda.set_sync_debug_mode("error")`` on from the end of a step that does not log to the end of
    the next one, when that one does not log either: Lightning's loop, the data transfer, the module, the strategy,
    the guard, the optimizer and every default callback run in between. A synchronization there raises."""

    def __new__(cls, log_every: int):
        import lightning.pytorch as pl
        import torch

        class _Strict(pl.Callback):
            def __init__(self) -> None:
                self.checked: list[int] = []
                self._on = False

            def on_train_batch_end(self, trainer, *args) -> None:
                step = trainer.global_step
                if self._on:
                    torch.cuda.set_sync_debug_mode("default")
                    self._on = False
                    self.checked.append(step)
                quiet = step % log_every and (step + 1) % log_every and step + 1 < trainer.max_steps
                if step > 1 and quiet:  # after the first step (allocator and kernel warm-up)
                    torch.cuda.set_sync_debug_mode("error")
                    self._on = True

            def on_train_end(self, trainer, *args) -> None:
                torch.cuda.set_sync_debug_mode("default")

        return _Strict()
