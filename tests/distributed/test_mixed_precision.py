"""bf16 mixed precision the FSDP2 way (bf16 parameters for compute, fp32 gradient reduction) against one process.

Tolerance: both runs do their matmuls in bf16 (autocast in one process; FSDP2's bf16 parameter copies plus autocast
in the layouts). They differ only in where fp32 values are rounded to bf16 (FSDP2 rounds the gathered parameters,
norm scales included) and in the order of the fp32 gradient reduction. One bf16 rounding is 2^-8 = 3.9e-3 relative;
rtol 1e-3 over ten steps says no error beyond a fraction of one rounding builds up (measured: 5e-5 for fsdp2 and
tp2 x fsdp2, on 2026-11-23).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, assert_planned, losses, run_app
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_dist.parallel.data import param_dtype_of

BF16 = ["cluster.precision=bf16-mixed"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *BF16, "parallelism=fsdp", "cluster.devices=1"], tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=fsdp", "cluster.devices=2"],
        ["parallelism=tp_fsdp", "cluster.devices=4"],
        ["parallelism=tp", "cluster.devices=2"],  # autocast alone: fp32 residual stream, bf16 matmul outputs
        ["parallelism=pp", "cluster.devices=2", "parallelism.pipeline.microbatches=4"],
    ],
    ids=["fsdp2", "tp2xfsdp2", "tp2", "pp2"],
)
def test_bf16_layouts_match_one_process_bf16(layout: list[str], one_process: dict, tmp_path: Path) -> None:
    result = run_app([*FAST, *BF16, *layout], tmp_path)
    assert len(losses(result)) == 10 and np.isfinite(losses(result)).all()
    np.testing.assert_allclose(losses(result), losses(one_process), rtol=1e-3)
    assert_planned(result)  # bf16 gathers and activations, fp32 reductions: the planner's bytes exactly


def test_mixed_precision_maps_to_fsdp2_compute_dtypes() -> None:
    assert param_dtype_of(MixedPrecision("bf16-mixed", "cpu").precision) == torch.bfloat16
    assert param_dtype_of(MixedPrecision("16-mixed", "cpu").precision) == torch.float16
    assert param_dtype_of("32-true") is None  # parameters keep their dtype
