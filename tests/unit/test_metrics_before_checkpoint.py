"""A checkpoint is published only once the metrics rows of the steps it holds are on disk: a run killed right after a
save never continues from a checkpoint whose steps' rows were still in a logger's memory (the probe: 2 of 7 ranks
killed right after a save dropped that step's row from metrics.csv). Lightning's own loop, CSV logger and checkpoint
flow, one process: the invariant is checked at every hook, as a kill could come at any of them."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from helpers import quiet_trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.checkpoint.folder import pointed


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


class RowsOnDisk(pl.Callback):
    """After RunCheckpoints: at every hook, the newest published checkpoint's steps each have a row in metrics.csv
    on disk (a kill here would leave what is checked)."""

    def __init__(self, checkpoints: Path, metrics: Path) -> None:
        self.checkpoints, self.metrics, self.checked = checkpoints, metrics, 0

    def _check(self, *args) -> None:
        latest = pointed(self.checkpoints)
        if latest is None:
            return
        saved = int(latest.name.removeprefix("step-"))
        rows = list(csv.DictReader(self.metrics.open())) if self.metrics.is_file() else []
        logged = {int(row["step"]) for row in rows if row.get("train/loss")}
        assert set(range(saved)) <= logged, f"{latest.name} published with rows of steps {sorted(logged)} on disk"
        self.checked += 1

    on_train_batch_start = on_train_batch_end = on_validation_start = on_train_end = _check


def test_a_checkpoint_is_published_after_the_rows_of_its_steps(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv", version="")  # writes its rows every 100 steps by default
    saver = RunCheckpoints(tmp_path / "checkpoints", every_n_steps=3, keep_last=1)
    checker = RowsOnDisk(tmp_path / "checkpoints", tmp_path / "csv" / "metrics.csv")
    trainer = quiet_trainer("auto", 1, 10, [saver, checker], logger=logger)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny())
    assert checker.checked > 10 and pointed(tmp_path / "checkpoints").name == "step-00000010"
