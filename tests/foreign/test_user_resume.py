"""Mid-epoch resume of a user's own loader through our loader dealing (Lightning's stateful data loading)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from helpers import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy
from lightning_dist.run.launch import launch

STEPS, STOP = 12, 5  # an epoch of 16 global batches, stopped mid-way


class PositionLoader(DataLoader):
    """A loader that can save its position: what Lightning's stateful loading asks of one (state_dict / load)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.position, self.resume_at = 0, 0

    def __iter__(self):
        batches = super().__iter__()
        for _ in range(self.resume_at):
            next(batches)
        self.position, self.resume_at = self.resume_at, 0
        for batch in batches:
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["position"]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> PositionLoader:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    order = torch.Generator().manual_seed(3)
    return PositionLoader(TensorDataset(x, x.cos().sum(-1)), batch_size=2, shuffle=True, generator=order)


def _fit(out: str, max_steps: int, ckpt_path: str | None = None) -> list[float]:
    module = Regressor()
    checkpoints = [ModelCheckpoint(dirpath=out, save_last=True, save_top_k=0)]
    trainer = quiet_trainer(MeshStrategy(dp_shard=2), 2, max_steps, callbacks=checkpoints, enable_checkpointing=True)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return module.losses


def _runs(out: str) -> dict[str, list[float]]:
    full = _fit(f"{out}/full", STEPS)
    first = _fit(f"{out}/first", STOP)
    resumed = _fit(f"{out}/resumed", STEPS, ckpt_path=f"{out}/first/last.ckpt")
    return {"full": full, "first": first, "resumed": resumed}


def test_a_stateful_loader_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    for rank in launch(_runs, 2, str(tmp_path)):
        assert rank["first"] == rank["full"][:STOP]
        np.testing.assert_allclose(rank["resumed"], rank["full"][STOP:], rtol=1e-6)
