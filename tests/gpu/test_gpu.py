"""GPU-only checks (bf16, CUDA memory, NCCL). Skipped on machines without CUDA; run them on a GPU box."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST, losses, run_app
from sync_debug import NoSyncBetweenQuietSteps

pytestmark = pytest.mark.gpu


def test_bf16_mixed_on_one_gpu_trains(tmp_path: Path) -> None:
    result = run_app([*FAST, "cluster=gpu", "trainer.max_steps=30"], tmp_path)
    assert losses(result)[-1] < losses(result)[0] - 0.3


def test_bf16_fsdp2_matches_fp32_within_bf16_rounding(tmp_path: Path) -> None:
    bf16 = run_app([*FAST, "cluster=gpu", "parallelism=fsdp"], tmp_path / "bf16")
    fp32 = run_app([*FAST, "cluster=gpu", "parallelism=fsdp", "cluster.precision=32-true"], tmp_path / "fp32")
    for a, b in zip(losses(bf16), losses(fp32)):
        assert abs(a - b) / b < 2e-2


def _fit_without_syncs(cfg) -> list[int]:
    from lightning_dist.run.fit import fit

    strict = NoSyncBetweenQuietSteps(cfg.trainer.log_every_n_steps)
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


def test_an_async_sharded_checkpoint_resumes_in_a_new_folder_bit_identically(tmp_path: Path) -> None:
    """FSDP2, bf16, a background (DCP async) save at step 5 on CUDA; a new run from it repeats steps 6-10."""
    saving = ["cluster=gpu", "parallelism=fsdp", "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=5",
              "checkpoint.async_save=true"]  # fmt: skip
    whole = run_app([*FAST, *saving], tmp_path / "whole")
    half = tmp_path / "whole" / "checkpoints" / "step-00000005"
    resumed = run_app([*FAST, *saving, f"ckpt_path={half}"], tmp_path / "resumed")
    assert losses(resumed) == losses(whole)[5:]
