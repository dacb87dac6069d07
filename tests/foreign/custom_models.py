"""A user's own package, as the app's model=custom / data=custom reach it by import path (not a test file)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.body(x).squeeze(-1), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RegressionData(pl.LightningDataModule):
    def __init__(self, batch_size: int, width: int = 8, samples: int = 256) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, width, generator=generator)
        self.y = self.x.sin().sum(-1)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        order = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True, generator=order)
