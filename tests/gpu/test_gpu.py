"""GPU-only checks (bf16, CUDA memory, NCCL). Skipped on machines without CUDA; run them on a GPU box."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST, losses, run_app

pytestmark = pytest.mark.gpu


def test_bf16_mixed_on_one_gpu_trains(tmp_path: Path) -> None:
    result = run_app([*FAST, "cluster=gpu", "trainer.max_steps=30"], tmp_path)
    assert losses(result)[-1] < losses(result)[0] - 0.3


def test_bf16_fsdp2_matches_fp32_within_bf16_rounding(tmp_path: Path) -> None:
    bf16 = run_app([*FAST, "cluster=gpu", "parallelism=fsdp"], tmp_path / "bf16")
    fp32 = run_app([*FAST, "cluster=gpu", "parallelism=fsdp", "cluster.precision=32-true"], tmp_path / "fp32")
    for a, b in zip(losses(bf16), losses(fp32)):
        assert abs(a - b) / b < 2e-2


class _NoSyncBetweenQuietSteps:
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


def _fit_without_syncs(cfg) -> list[int]:
    from lightning_dist.run.fit import fit

    strict = _NoSyncBetweenQuietSteps(cfg.trainer.log_every_n_steps)
    fit(cfg, callbacks=[strict])
    return strict.checked


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_steps_that_do_not_log_never_synchronize_the_gpu(parallelism: str, tmp_path: Path) -> None:
    from helpers import compose_config

    from lightning_dist.run.launch import launch

    settings = ["trainer.max_steps=12", "trainer.log_every_n_steps=5", "trainer.enable_progress_bar=true"]
    cfg = compose_config([*FAST, *settings, "cluster=gpu", f"parallelism={parallelism}"], tmp_path)
    checked = launch(_fit_without_syncs, 1, cfg)[0]
    assert checked == [3, 4, 7, 8, 9], checked  # quiet pairs (2,3) (3,4) (6,7) (7,8) (8,9): none synchronized
