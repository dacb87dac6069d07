"""Gradient accumulation keeps the global batch: any micro batch under any layout gives the one-process curve.

``data.micro_batch_size`` splits each rank's batch into forwards whose gradients add up before one optimizer step
(DDP ``no_sync`` / FSDP2 ``set_requires_gradient_sync(False)`` on all but the last); under pp the micro batches are
the pipeline's microbatches. The loss and gradient norm of every step equal one process's with the whole batch.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch.distributed as dist
from helpers import FAST, assert_planned, compose_config, losses, run_app

from lightning_dist.run.launch import launch
from lightning_dist.telemetry.torch_patches import c10d_name

REFERENCE = ["parallelism=fsdp", "cluster.devices=1"]  # data.global_batch_size=8 in one forward


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *REFERENCE], tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=fsdp", "cluster.devices=1", "data.micro_batch_size=4"],  # 2 micro steps
        ["parallelism=fsdp", "cluster.devices=2", "data.micro_batch_size=1"],  # 4 micro steps per rank
        ["parallelism=ddp", "cluster.devices=2", "data.micro_batch_size=2"],  # Lightning's DDP, no_sync
        ["parallelism=tp", "cluster.devices=2", "data.micro_batch_size=2"],  # tp2, 4 micro steps
        ["parallelism=pp", "cluster.devices=2", "data.micro_batch_size=2"],  # 4 pipeline microbatches
        ["parallelism=fsdp", "cluster.devices=2", "trainer.accumulate_grad_batches=2"],  # Lightning's knob maps
    ],
    ids=["one-mb4", "fsdp2-mb1", "ddp2-mb2", "tp2-mb2", "pp2-mb2", "fsdp2-accumulate2"],
)
def test_accumulated_layouts_match_one_process(layout: list[str], reference: dict, tmp_path: Path) -> None:
    result = run_app([*FAST, *layout], tmp_path)
    assert len(losses(result)) == 10  # one record per optimizer step, not per micro batch
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    assert_planned(result)
    if "train/grad_norm" in result["history"][0]:  # every strategy of ours logs it
        np.testing.assert_allclose(losses(result, "train/grad_norm"), losses(reference, "train/grad_norm"), rtol=1e-5)


class _ReduceScatters(pl.Callback):
    """Counts FSDP2's gradient reduce-scatters in each optimizer step's backward."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = c10d_name("reduce_scatter_single")  # what FSDP2 calls: reduce_scatter_tensor on torch 2.11
        self.calls, original = [0], getattr(dist, name)

        def counted(*args, **kwargs):
            self.calls[0] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_step = self.calls[0] / trainer.global_step


def _count_reduce_scatters(cfg) -> float:
    from lightning_dist.run.fit import fit

    probe = _ReduceScatters()
    fit(cfg, callbacks=(probe,))
    return probe.per_step


def test_accumulating_micro_steps_do_not_reduce_gradients(tmp_path: Path) -> None:
    steps = ["trainer.max_steps=3", "telemetry.enabled=false", "parallelism=fsdp", "cluster.devices=2"]
    whole = launch(_count_reduce_scatters, 2, compose_config([*FAST, *steps], tmp_path / "whole"))
    micro = launch(
        _count_reduce_scatters, 2, compose_config([*FAST, *steps, "data.micro_batch_size=1"], tmp_path / "mb")
    )
    assert whole[0] > 0
    assert micro == whole  # one reduce-scatter per FSDP unit and step, however many micro batches


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.micro_batch_size=3"], r"data.micro_batch_size=3 does not divide the per-rank batch 4 \(data.global"),
        (["trainer.accumulate_grad_batches=3"], r"trainer.accumulate_grad_batches=3 does not divide the per-rank"),
        (
            ["data.micro_batch_size=1", "trainer.accumulate_grad_batches=2"],
            r"trainer.accumulate_grad_batches=2 contradicts data.micro_batch_size=1",
        ),
        (
            ["parallelism=pp", "data.micro_batch_size=1", "parallelism.pipeline.microbatches=2"],
            r"parallelism.pipeline.microbatches=2 contradicts data.micro_batch_size=1",
        ),
        (["data.micro_batch_size=0"], r"data.micro_batch_size=0 must be >= 1"),
    ],
    ids=["not-a-divisor", "accumulate-not-a-divisor", "both-disagree", "pp-disagree", "zero"],
)
def test_impossible_micro_batches_fail_before_launch(overrides: list[str], message: str) -> None:
    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_config([*FAST, "parallelism=fsdp", "cluster.devices=2", *overrides]))


def test_micro_batches_are_resolved_once_for_every_rank() -> None:
    from lightning_dist.config.validate import validate

    cfg = compose_config([*FAST, "parallelism=fsdp", "cluster.devices=2", "data.micro_batch_size=1"])
    cfg = validate(cfg).cfg
    cfg = validate(cfg).cfg  # a rank started without the app's launcher checks again: the same answer
    assert (cfg.trainer.accumulate_grad_batches, cfg.data.micro_batch_size) == (4, 1)
    pp = compose_config([*FAST, "parallelism=pp", "cluster.devices=2", "trainer.accumulate_grad_batches=2"])
    pp = validate(pp).cfg
    # Under pp, Lightning's accumulation becomes the pipeline's microbatches: one schedule step per global batch.
    assert (pp.trainer.accumulate_grad_batches, pp.parallelism.pipeline.microbatches, pp.data.micro_batch_size) == (
        1,
        2,
        4,
    )
