"""A user's classifier through every Trainer entry point (fit, resume, validate, test, predict) under fsdp, tp and pp.

Written the way Lightning users write one: ``self(x)`` in ``validation_step`` / ``test_step`` / ``predict_step``,
torchmetrics metrics logged as objects, a step-interval LR scheduler, gradient clipping,
``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and a resume from ``last.ckpt``. Every layout must give what one
process gives: the losses, the learning rates, the metrics (a ``SumMetric`` of the samples seen counts each sample
once, not once per tp / pp peer), the callbacks' state and every prediction. Under pp the model's outputs come from
the pipeline's last stage (before, each rank returned what its own stage computed, with no error), and
``accumulate_grad_batches`` accumulates schedule steps (before, it was refused).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_dist import MeshStrategy, PipelineParallelStrategy, PipelineSpec, TensorParallelStrategy
from lightning_dist.run.launch import launch

WIDTH, CLASSES, SAMPLES, BATCH = 8, 4, 32, 8  # one process: 4 steps an epoch


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)
        )  # fmt: skip
        self.val_acc, self.test_acc = MulticlassAccuracy(CLASSES), MulticlassAccuracy(CLASSES)
        self.val_seen, self.test_seen = SumMetric(), SumMetric()
        self.record: dict[str, list[float]] = {"loss": [], "lr": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", loss_fn=F.cross_entropy, split_batch=lambda batch: batch[:2])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.record["loss"].append(float(self.trainer.callback_metrics["train/loss"]))
        self.record["lr"].append(self.optimizers().param_groups[0]["lr"])

    def _evaluate(self, batch: Any, stage: str, accuracy: MulticlassAccuracy, seen: SumMetric) -> None:
        x, y, _ = batch
        logits = self(x)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), sync_dist=True)
        accuracy(logits, y)
        seen.update(torch.tensor(float(len(y))))
        self.log(f"{stage}/acc", accuracy)
        self.log(f"{stage}/seen", seen)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc, self.val_seen)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc, self.test_seen)

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _, index = batch
        return index, self(x).softmax(-1)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loader(seed: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, WIDTH, generator=generator)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(SAMPLES, CLASSES, generator=generator)).argmax(-1)
    return DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=batch_size)


def _trainer(strategy: Any, devices: int, root: Path, max_epochs: int, **kwargs: Any) -> tuple[pl.Trainer, list]:
    checkpoint = ModelCheckpoint(dirpath=root / "checkpoints", monitor="val/loss", save_top_k=1, save_last=True)
    stopping = EarlyStopping(monitor="val/loss", patience=3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs, gradient_clip_val=0.5,
        callbacks=[checkpoint, stopping], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, log_every_n_steps=1, **kwargs,
    )  # fmt: skip
    return trainer, [checkpoint, stopping]


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in values.items()}


def _every_entry_point(make_strategy: Any, devices: int, dp: int, root: str) -> dict[str, Any]:
    """fit 2 epochs, resume from last.ckpt to 3, then validate, test and predict; everything a user reads."""
    batch, folder = BATCH // dp, Path(root)
    module = Classifier()
    trainer, (checkpoint, stopping) = _trainer(make_strategy(), devices, folder, max_epochs=2)
    trainer.fit(module, _loader(0, batch), _loader(1, batch))
    out: dict[str, Any] = {**module.record, "fit_metrics": _metrics(trainer.callback_metrics)}
    out["best_score"], out["stopping"] = float(checkpoint.best_model_score), float(stopping.best_score)

    module = Classifier()
    trainer, (checkpoint, stopping) = _trainer(make_strategy(), devices, folder, max_epochs=3)
    trainer.fit(module, _loader(0, batch), _loader(1, batch), ckpt_path=str(folder / "checkpoints" / "last.ckpt"))
    out["resumed_loss"], out["resumed_lr"] = module.record["loss"], module.record["lr"]
    out["resumed_best"], out["wait_count"] = float(checkpoint.best_model_score), stopping.wait_count
    out["validate"] = _metrics(trainer.validate(module, _loader(1, batch))[0])
    out["test"] = _metrics(trainer.test(module, _loader(2, batch))[0])
    predictions = trainer.predict(module, _loader(3, batch // 2))  # not fit's batch: pp stages size buffers again
    out["predict"] = {int(i): row.tolist() for index, probs in predictions for i, row in zip(index, probs)}
    # The strategy gave the metrics its dp group only while it ran: the module is the user's again afterwards.
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    out["metrics_restored"] = all(m.process_group is None and m.dist_sync_fn is None for m in metrics)
    return out


def _accumulated(make_strategy: Any, devices: int, root: str) -> list[float]:
    """Each loader batch's loss with two batches per optimizer step: every loss after the first step depends on it."""
    module = Classifier()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=make_strategy(), max_epochs=1, accumulate_grad_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, _loader(0, BATCH))
    return module.record["loss"]


def _fsdp() -> MeshStrategy:
    return MeshStrategy(dp_shard=2)


def _tp() -> TensorParallelStrategy:
    return TensorParallelStrategy(tp=2, plan={"net.0": "colwise", "net.2": "rowwise"})


def _pp() -> PipelineParallelStrategy:
    return PipelineParallelStrategy(pp=2, microbatches=2)


def _two_ranks(root: str) -> dict[str, Any]:
    return {
        "fsdp": _every_entry_point(_fsdp, 2, 2, f"{root}/fsdp"),
        "tp": _every_entry_point(_tp, 2, 1, f"{root}/tp"),
        "pp": _every_entry_point(_pp, 2, 1, f"{root}/pp"),
        "pp_accumulate": _accumulated(_pp, 2, f"{root}/pp-accumulate"),
    }


def _four_ranks(root: str) -> dict[str, Any]:
    """Model parallel beside data parallel: metrics and sync_dist reduce over the dp group (2 of the 4 ranks)."""
    pp_dp = partial(MeshStrategy, pp=2, dp_shard=2, microbatches=2)
    tp_dp = partial(MeshStrategy, tp=2, dp_shard=2, plan={"net.0": "colwise", "net.2": "rowwise"})
    return {
        "pp2xdp2": _every_entry_point(pp_dp, 4, 2, f"{root}/pp2xdp2"),
        "tp2xdp2": _every_entry_point(tp_dp, 4, 2, f"{root}/tp2xdp2"),
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one")
    return {
        "run": _every_entry_point(lambda: "auto", 1, 1, str(root / "run")),
        "accumulate": _accumulated(lambda: "auto", 1, str(root / "accumulate")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_two_ranks, 2, str(tmp_path_factory.mktemp("two")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_four_ranks, 4, str(tmp_path_factory.mktemp("four")))


def _assert_same(run: dict[str, Any], reference: dict[str, Any]) -> None:
    for key in ("loss", "lr", "resumed_loss", "resumed_lr"):
        assert len(run[key]) == len(reference[key]), key
        np.testing.assert_allclose(run[key], reference[key], rtol=1e-5, err_msg=key)
    for key in ("best_score", "stopping", "resumed_best"):
        np.testing.assert_allclose(run[key], reference[key], rtol=1e-5, err_msg=key)
    assert run["wait_count"] == reference["wait_count"]
    for key in ("fit_metrics", "validate", "test"):
        assert run[key].keys() >= reference[key].keys(), key  # our strategies add train/grad_norm
        for name, value in reference[key].items():
            np.testing.assert_allclose(run[key][name], value, rtol=1e-5, err_msg=f"{key}: {name}")
    assert run["metrics_restored"]
    assert sorted(run["predict"]) == sorted(reference["predict"]) == list(range(SAMPLES))
    for index, probs in reference["predict"].items():
        np.testing.assert_allclose(run["predict"][index], probs, rtol=1e-5, atol=1e-7, err_msg=f"prediction {index}")


@pytest.mark.parametrize("layout", ["fsdp", "tp", "pp"])
def test_every_entry_point_equals_one_process(layout: str, two_ranks: list[dict[str, Any]], one_process) -> None:
    reference = one_process["run"]
    assert reference["validate"]["val/seen"] == reference["test"]["test/seen"] == SAMPLES
    for rank in two_ranks:
        run = rank[layout]
        if layout == "fsdp":  # each data-parallel rank predicts its share of the samples
            run = {**run, "predict": {i: p for r in two_ranks for i, p in r[layout]["predict"].items()}}
        _assert_same(run, reference)


@pytest.mark.parametrize("layout", ["pp2xdp2", "tp2xdp2"])
def test_every_entry_point_equals_one_process_on_four_ranks(layout: str, four_ranks, one_process) -> None:
    for rank in four_ranks:
        predictions = {i: p for r in four_ranks for i, p in r[layout]["predict"].items()}  # dp ranks' shares
        _assert_same({**rank[layout], "predict": predictions}, one_process["run"])


def test_gradient_accumulation_under_a_pipeline_equals_one_process(two_ranks, one_process) -> None:
    for rank in two_ranks:
        np.testing.assert_allclose(rank["pp_accumulate"], one_process["accumulate"], rtol=1e-5)
