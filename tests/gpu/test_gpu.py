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
