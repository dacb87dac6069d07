"""``parallelism.float8``: torchao's float8 linears (emulated on CPU) compose with every layout they claim, each
giving the one-process float8 curve: FSDP2 (tensorwise: weights all-gathered in float8, the bytes the planner
counts), TP with torchao's float8 styles, the pipeline, context parallelism and Lightning's DDP. Checkpoints keep the
high-precision weights: a float8 run resumes exactly, and without float8. One spawned group of two ranks runs every
layout case; DiLoCo's replicas with float8 stay within the float8 tolerance of DiLoCo without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import FAST, compose_config, quiet_trainer, run_app
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.options import Parallelism
from lightning_dist.run.launch import launch
from lightning_dist.strategies import DataParallelStrategy

STEPS, BATCH, SEQ = 4, 4, 32
MODEL = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)


def _fit(strategy: Any, devices: int, dp: int = 1, accumulate: int = 1) -> dict[str, Any]:
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // dp // accumulate)
    module = GPTModule(MODEL, OptimConfig(lr=1e-2, warmup_steps=0), STEPS)
    losses: list[float] = []
    norms: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if (index + 1) % accumulate == 0:  # the optimizer step's last micro batch: its loss and norm are logged
                losses.append(float(trainer.callback_metrics["train/loss"]))
                norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    trainer = quiet_trainer(strategy, devices, STEPS, callbacks=[Record()], accumulate_grad_batches=accumulate)
    trainer.fit(module, loader)
    kinds = {type(m).__name__ for name, m in module.named_modules() if name.startswith("model.layers.")}
    outside = {type(m).__name__ for name, m in module.named_modules() if name in ("model.head", "model.tok_emb")}
    return {"losses": losses, "norms": norms, "block_layers": kinds, "outside": outside}


#: name -> (the one-process reference: recipe and micro batch, data-parallel ranks, the strategy). tensorwise scales
#: are dynamic per tensor, so per forward: a layout that splits the batch (dp, pipeline microbatches) is matched by one
#: process running the same micro batches (its amax over the same tokens); rowwise scales are per token, any split.
CASES: dict[str, tuple[tuple[str, int], int, Any]] = {
    "fsdp2-tensorwise": (("tensorwise", 2), 2, lambda: MeshStrategy(dp_shard=2, float8="tensorwise")),
    "fsdp2-rowwise": (("rowwise", 4), 2, lambda: MeshStrategy(dp_shard=2, float8="rowwise")),
    # torchao's float8 styles; with sequence parallelism their float8 gradient all-gathers need NCCL (gloo refuses)
    "tp2-tensorwise": (
        ("tensorwise", 4),
        1,
        lambda: TensorParallelStrategy(tp=2, float8="tensorwise", sequence_parallel=False),
    ),
    "tp2-rowwise-sp": (("rowwise", 4), 1, lambda: TensorParallelStrategy(tp=2, float8="rowwise")),
    "pp2-tensorwise": (
        ("tensorwise", 2),
        1,
        lambda: PipelineParallelStrategy(pp=2, dp_shard=1, microbatches=2, float8="tensorwise"),
    ),
    "ddp2-tensorwise": (
        ("tensorwise", 2),
        2,
        lambda: DataParallelStrategy(parallelism=Parallelism(float8="tensorwise")),
    ),
}


def _two_ranks() -> dict[str, Any]:
    results = {name: _fit(make(), 2, dp) for name, (_, dp, make) in CASES.items()}
    # cp: each rank's activation scales see its half of the sequence; no one-process run computes those
    results["cp2-tensorwise"] = _fit(MeshStrategy(cp=2, dp_shard=1, float8="tensorwise"), 2)
    # DiLoCo: two replicas apart for a step, then the outer step (tensorwise over a size-1 FSDP2 mesh per replica)
    for recipe in ("off", "tensorwise"):
        diloco = MeshStrategy(dp_replicate=2, dp_shard=1, sync="diloco", every=2, float8=recipe)
        results[f"diloco2-{recipe}"] = _fit(diloco, 2, dp=2)
    try:
        _fit(TensorParallelStrategy(tp=2, float8="tensorwise"), 2)
    except ValueError as err:
        results["refused"] = str(err)
    return results


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    runs = {key: _fit(MeshStrategy(dp_shard=1, float8=key[0]), 1, accumulate=BATCH // key[1])
            for key in {case[0] for case in CASES.values()}}  # fmt: skip
    return {**runs, "off": _fit(MeshStrategy(dp_shard=1), 1)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_float8_layouts_give_the_one_process_float8_curve(case: str, two_ranks, one_process) -> None:
    reference = one_process[CASES[case][0]]
    assert reference["block_layers"] >= {"Float8Linear"} and "Linear" not in reference["block_layers"]
    assert reference["outside"] == {"Linear", "Embedding"}  # the head and the embedding stay high precision
    assert reference["losses"] != one_process["off"]["losses"]  # float8 changed the numbers: it ran
    for rank in two_ranks:
        result = rank[case]
        assert "Float8Linear" in result["block_layers"]
        np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
        np.testing.assert_allclose(result["norms"], reference["norms"], rtol=1e-4)


def test_float8_under_cp_and_diloco_stays_within_the_float8_tolerance(two_ranks, one_process) -> None:
    from lightning_dist.parallel.float8 import FLOAT8_LOSS_RTOL

    for rank in two_ranks:
        losses = rank["cp2-tensorwise"]["losses"]
        np.testing.assert_allclose(losses, one_process["off"]["losses"], rtol=FLOAT8_LOSS_RTOL)
        diloco, plain = rank["diloco2-tensorwise"], rank["diloco2-off"]
        assert "Float8Linear" in diloco["block_layers"] and diloco["losses"] != plain["losses"]
        np.testing.assert_allclose(diloco["losses"], plain["losses"], rtol=FLOAT8_LOSS_RTOL)
        assert rank["refused"].startswith("float8=tensorwise with tp and sequence_parallel=true all-gathers float8")


def test_float8_all_gathers_are_the_planned_bytes(tmp_path: Path) -> None:
    """FSDP2 with tensorwise float8 all-gathers the converted weights in float8: the telemetry's dp bytes per step
    are the planner's, which counts 1 byte for them (4 for the fp32 norms, embedding and head)."""
    from helpers import assert_planned

    result = run_app([*FAST, "parallelism=fsdp", "parallelism.float8=tensorwise", "trainer.max_steps=3"], tmp_path)
    assert_planned(result)


def test_a_float8_checkpoint_resumes_exactly_and_without_float8(tmp_path: Path) -> None:
    """Checkpoints keep the fp32 weights: 4 float8 steps equal 2 + 2 resumed from the float8 run's checkpoint, and the
    same checkpoint resumes with float8 off (its first loss within the measured float8 tolerance)."""
    run = [*FAST, "parallelism=fsdp", "trainer.max_steps=4", "trainer.enable_checkpointing=true",
           "checkpoint.every_n_steps=2"]  # fmt: skip
    whole = run_app([*run, "parallelism.float8=tensorwise"], tmp_path / "whole")
    half = compose_config([*run, "parallelism.float8=tensorwise", "trainer.max_steps=2"], tmp_path / "half")
    from lightning_dist.run.train import run as run_training

    first = run_training(half)
    resumed = run_app([*run, "parallelism.float8=tensorwise", f"ckpt_path={first['checkpoint']}"], tmp_path / "again")
    bf = run_app([*run, f"ckpt_path={first['checkpoint']}"], tmp_path / "off")
    losses = [r["train/loss"] for r in whole["history"]]
    np.testing.assert_allclose([r["train/loss"] for r in resumed["history"]], losses[2:], rtol=1e-6)
    np.testing.assert_allclose([r["train/loss"] for r in bf["history"]], losses[2:], rtol=2e-2)
