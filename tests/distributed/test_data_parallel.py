"""Lightning's DDP and FSDP through the app: 2 processes give the one-process losses (same seed, global batch)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FAST, assert_planned, losses, run_app


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return losses(run_app([*FAST, "cluster.devices=1"], tmp_path_factory.mktemp("single")))


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_processes_match_one_process(parallelism: str, one_process: list[float], tmp_path) -> None:
    result = run_app([*FAST, f"parallelism={parallelism}", "cluster.devices=2"], tmp_path)
    assert len(losses(result)) == len(one_process) == 10
    np.testing.assert_allclose(losses(result), one_process, rtol=1e-5)
    assert losses(result)[-1] < losses(result)[0]  # it trains
    assert_planned(result)
