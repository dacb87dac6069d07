"""PipelineParallelStrategy on CPU (gloo): every schedule and layout gives the one-process losses and grad norms."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import FAST, assert_planned, compose_config, losses, run_app
from torch import nn

from lightning_dist import PipelineParallelStrategy
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.run.launch import launch

REFERENCE = ["parallelism=fsdp", "cluster.devices=1"]  # our strategy with every degree 1: one-process training
FOUR_LAYERS = "model.n_layers=4"  # 4 stages (pp=2 x 2 virtual stages) need 4 blocks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *REFERENCE], tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference_4l(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *REFERENCE, FOUR_LAYERS], tmp_path_factory.mktemp("reference_4l"))


def assert_same_run(result: dict, reference: dict) -> None:
    assert len(losses(result)) == len(losses(reference)) == 10
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    np.testing.assert_allclose(losses(result, "train/grad_norm"), losses(reference, "train/grad_norm"), rtol=1e-4)
    if "prediction" in result:  # the app's summary (a rank's own fit result has none)
        assert_planned(result)


def _fit_all_ranks(cfg) -> dict:
    from lightning_dist.run.fit import fit

    return fit(cfg)


def test_single_stage_schedules_match_one_process_on_every_rank(reference: dict, tmp_path: Path) -> None:
    """GPipe and 1F1B at pp=2; the loss every rank logs (not only the last stage's) is the one-process loss."""
    for schedule in ("GPipe", "1F1B"):
        overrides = [*FAST, "parallelism=pp", "cluster.devices=2", f"parallelism.pipeline.schedule={schedule}"]
        cfg = compose_config([*overrides, "parallelism.pipeline.microbatches=4"], tmp_path / schedule)
        ranks = launch(_fit_all_ranks, 2, cfg)
        for rank in ranks:
            assert_same_run(rank, reference)


@pytest.mark.parametrize(
    "schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_multi_stage_schedules_match_one_process(schedule: str, reference_4l: dict, tmp_path: Path) -> None:
    layout = ["parallelism=pp", "cluster.devices=2", f"parallelism.pipeline.schedule={schedule}"]
    result = run_app(
        [*FAST, *layout, FOUR_LAYERS, "parallelism.pipeline.stages_per_rank=2", "parallelism.pipeline.microbatches=4"],
        tmp_path,
    )
    assert_same_run(result, reference_4l)


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=pp", "cluster.devices=4", "parallelism.dp_shard=2"],
        ["parallelism=3d", "cluster.devices=4", "parallelism.dp_shard=1"],
    ],
    ids=["pp2xfsdp2", "pp2xtp2"],
)
def test_pipeline_composes_with_fsdp_and_tp(layout: list[str], reference: dict, tmp_path: Path) -> None:
    result = run_app([*FAST, *layout, "parallelism.pipeline.microbatches=2"], tmp_path)
    assert_same_run(result, reference)
    # strategy.describe(all_ranks=True), as the app keeps it: which stage, blocks, TP styles and FSDP2 units each
    # rank holds (the 2-block GPT: one block per stage).
    tp = "parallelism=3d" in layout
    held = result["rank_layouts"]
    assert [rank["rank"] for rank in held] == [0, 1, 2, 3]
    for rank in held:
        stage = rank["coordinates"]["pp"]
        assert (rank["stages"], rank["blocks"]) == ([stage], [[f"layers.{stage}"]])
        styles = rank["tp_styles"]
        assert styles.get(f"model.layers.{stage}.attn.q_proj") == ("ColwiseParallel" if tp else None)
        assert f"model.layers.{1 - stage}.attn.q_proj" not in styles  # the other stage's block is not here
        units = rank["fsdp_units"]
        assert units == [] if tp else f"stage {stage}: model.layers.{stage}" in units


def test_tied_embedding_and_head_on_different_stages_match_one_process(tmp_path: Path) -> None:
    # The head's stage holds a copy of the embedding matrix: values broadcast from the embedding's stage, gradients
    # summed over both, and no weight decay on the copy (the embedding gets none in one process).
    tied = [*FAST, "model.tie_embeddings=true"]
    one = run_app([*tied, *REFERENCE], tmp_path / "one")
    result = run_app([*tied, "parallelism=pp", "cluster.devices=2"], tmp_path / "pp")
    np.testing.assert_allclose(losses(result), losses(one), rtol=1e-5)
    np.testing.assert_allclose(losses(result, "train/grad_norm"), losses(one, "train/grad_norm"), rtol=1e-5)
    # Tensor parallelism shards both the same way (vocab rows), so they stay one parameter there too.
    result = run_app([*tied, "parallelism=tp", "cluster.devices=2"], tmp_path / "tp")
    np.testing.assert_allclose(losses(result), losses(one), rtol=1e-5)
    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"model.tie_embeddings=true with parallelism.pp=2 and parallelism.tp=2"):
        validate(compose_config([*tied, "parallelism=3d", "cluster.devices=4"]))


def test_validation_and_sanity_check_run_through_the_schedule(tmp_path: Path) -> None:
    val = ["trainer.num_sanity_val_steps=1", "trainer.limit_val_batches=2", "trainer.val_check_interval=5"]
    single = run_app([*FAST, *REFERENCE, *val], tmp_path / "single")
    piped = run_app([*FAST, "parallelism=pp", "cluster.devices=2", *val], tmp_path / "pp")
    assert piped["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


def test_exact_resume_in_the_same_layout(tmp_path: Path) -> None:
    layout = [*FAST, "parallelism=pp", "cluster.devices=2", "optim.decay_steps=20", "trainer.enable_checkpointing=true"]
    full = run_app([*layout, "trainer.max_steps=20"], tmp_path / "full")
    first = run_app([*layout, "trainer.max_steps=10"], tmp_path / "first")
    resumed = run_app([*layout, "trainer.max_steps=20", f"ckpt_path={first['checkpoint']}"], tmp_path / "resumed")
    assert losses(first) == losses(full)[:10]
    assert len(losses(resumed)) == 10
    np.testing.assert_allclose(losses(resumed), losses(full)[10:], rtol=1e-6)


# ----------------------------------------------------------------------------------- a user's nn.Sequential model
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class SequentialModel(pl.LightningModule):
    """Not the GPT: an nn.Sequential of blocks (embedding in front, head behind), described by pipeline_spec(); its
    loss takes a keyword argument from the batch (as a masked batch's token normalizer), which pipelining passes as
    the schedule's loss_kwargs."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [("embed", nn.Embedding(vocab, width))]
        layers += [(f"block{i}", Block(width)) for i in range(depth)]
        layers += [("head", nn.Linear(width, vocab))]
        self.net = nn.Sequential(OrderedDict(layers))

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return scale * F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @staticmethod
    def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return batch[:, :-1], batch[:, 1:], {"scale": torch.tensor(0.5)}  # a loss without it would be 2x

    def compute_loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets, loss_kwargs = self.split_batch(batch)
        return self.loss_fn(self.net(inputs), targets, **loss_kwargs)

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", loss_fn=self.loss_fn, split_batch=self.split_batch)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


def _fit_user_model(pp: int) -> dict:
    torch.manual_seed(0)
    data = torch.randint(0, 32, (80, 9))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    record = _Losses()
    strategy = PipelineParallelStrategy(pp=pp, schedule="GPipe", microbatches=4) if pp > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=pp,
        strategy=strategy,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        # Lightning shuffles training data whenever it installs a DistributedSampler (any multi-process strategy)
        # and never on one device; with dp = 1 every pipeline rank reads the loader's own order, as one process does.
        use_distributed_sampler=False,
    )
    module = SequentialModel()
    trainer.fit(module, loader)
    names = sorted(name for name, _ in module.named_parameters())
    numel = sum(p.numel() for p in module.parameters())
    return {"losses": record.values, "names": names, "numel": numel}


def test_user_sequential_model_matches_one_process() -> None:
    single = launch(_fit_user_model, 1, 1)[0]
    ranks = launch(_fit_user_model, 2, 2)
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], single["losses"], rtol=1e-5)
    # Each rank holds a slice of the model under the full model's parameter names.
    assert sorted(ranks[0]["names"] + ranks[1]["names"]) == single["names"]
    assert ranks[0]["names"][0].startswith("net.")
    assert max(rank["numel"] for rank in ranks) <= 0.6 * single["numel"]


# --------------------------------------------------------------------------------------------- the pipeline bubble
class _Sleep(torch.autograd.Function):
    """Known compute time: forward sleeps ``seconds``, backward twice as long (like a real layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(super().forward(x), 0.08)  # long enough that a busy box's scheduling noise stays in atol


class SleepModel(SequentialModel):
    def __init__(self) -> None:
        super().__init__(depth=0)
        self.net = nn.Sequential(
            OrderedDict(
                [
                    ("embed", nn.Embedding(32, 16)),
                    ("b0", SleepBlock(16)),
                    ("b1", SleepBlock(16)),
                    ("head", nn.Linear(16, 32)),
                ]
            )
        )


def _bubble_under_gpipe(microbatches: int) -> list[float]:
    from lightning_dist import Telemetry

    telemetry = Telemetry(log_every_n_steps=1, print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PipelineParallelStrategy(pp=2, schedule="GPipe", microbatches=microbatches, split_points=["b1"]),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[telemetry],
        use_distributed_sampler=False,
    )
    trainer.fit(SleepModel(), torch.utils.data.DataLoader(torch.randint(0, 32, (48, 9)), batch_size=8))
    return [record["pipeline/bubble_fraction"] for record in telemetry.history]


@pytest.mark.parametrize("microbatches", [2, 8])
def test_bubble_fraction_matches_gpipe_theory(microbatches: int) -> None:
    """Sleeping blocks give a known schedule: GPipe idles (p-1)/(m+p-1) of each step, what Telemetry must log."""
    theory = (2 - 1) / (microbatches + 2 - 1)
    bubbles = launch(_bubble_under_gpipe, 2, microbatches)[0]
    assert len(bubbles) == 3
    # the first step also builds the schedule's buffers; the sleeps make steps 2 and 3 exact up to scheduling noise
    # (measured 0.385 for 0.333 with two test workers and two busy loops on 2 cores; m=4 would be 0.2)
    np.testing.assert_allclose(bubbles[1:], theory, atol=0.08)


def test_pp1_with_virtual_stages_and_dp_matches_one_process(reference_4l: dict, tmp_path: Path) -> None:
    """pp=1 is a layout without pipeline peers: virtual stages must never send to a data-parallel peer."""
    layout = ["parallelism=pp", "parallelism.pp=1", "parallelism.dp_shard=2", "cluster.devices=2"]
    schedule = [
        "parallelism.pipeline.schedule=Interleaved1F1B",
        "parallelism.pipeline.stages_per_rank=2",
        "parallelism.pipeline.microbatches=4",
    ]
    assert_same_run(run_app([*FAST, *layout, *schedule, FOUR_LAYERS], tmp_path), reference_4l)
