"""A user's own module and own DataLoader, with Lightning's defaults (``use_distributed_sampler`` left on).

The data order must be the one-process order: with dp=1 (pure TP) the loader is left as it is; with dp>1 global
batch k (the ranks' batches k side by side) is batch k of one process whose loader has the global batch size, for a
sequential and a seeded shuffled loader alike. Before, Lightning put a shuffling DistributedSampler in front even at
dp=1 (first loss 0.766 vs 0.658 one-process, exit 0).
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import GradNorms, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy, TensorParallelStrategy
from lightning_dist.run.launch import launch
from lightning_dist.strategies import DataParallelStrategy

GLOBAL_BATCH, STEPS = 8, 8
PLAN = {"trunk.expand": "colwise", "trunk.contract": "rowwise"}


class Regressor(pl.LightningModule):
    """Written the way users write them: own attribute names, Lightning defaults, loss logged with sync_dist."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.ModuleDict({"expand": nn.Linear(8, 32), "contract": nn.Linear(32, 8)})
        self.head = nn.Linear(8, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = x + self.trunk["contract"](torch.tanh(self.trunk["expand"](x)))
        loss = F.mse_loss(self.head(hidden).squeeze(-1), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(batch_size: int, shuffle: bool) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * STEPS, 8, generator=generator)
    y = x.sum(-1) + 0.1 * torch.randn(GLOBAL_BATCH * STEPS, generator=generator)
    sampler_generator = torch.Generator().manual_seed(7) if shuffle else None
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=sampler_generator)


def _fit(layout: str) -> dict[str, list[float]]:
    strategies = {
        "one": lambda: "auto",
        "tp2": lambda: TensorParallelStrategy(tp=2, plan=PLAN),
        "dp2": lambda: MeshStrategy(dp_shard=2),
        "ddp2": lambda: DataParallelStrategy(),  # the app's parallelism=ddp: Lightning's DDP, loader order kept
    }
    devices = 1 if layout == "one" else 2
    dp = 2 if layout in ("dp2", "ddp2") else 1
    out = {}
    for shuffle in (False, True):
        module = Regressor()
        grad_norms = GradNorms()
        trainer = quiet_trainer(strategies[layout](), devices, STEPS, callbacks=[grad_norms])
        trainer.fit(module, _loader(GLOBAL_BATCH // dp, shuffle))
        kind = "shuffled" if shuffle else "sequential"
        out[kind], out[f"{kind}_grad_norms"] = module.losses, grad_norms.values
    return out


@pytest.fixture(scope="module")
def one_process() -> dict[str, list[float]]:
    return _fit("one")  # in this process: a one-process reference needs no spawned rank


@pytest.mark.parametrize("layout", ["tp2", "dp2", "ddp2"])
def test_own_loader_keeps_the_one_process_order(layout: str, one_process: dict[str, list[float]]) -> None:
    for rank in launch(_fit, 2, layout):
        for kind in ("sequential", "shuffled"):
            assert len(rank[kind]) == STEPS
            np.testing.assert_allclose(rank[kind], one_process[kind], rtol=1e-5, err_msg=f"{layout} {kind}")
            norms = f"{kind}_grad_norms"
            np.testing.assert_allclose(rank[norms], one_process[norms], rtol=1e-4, err_msg=f"{layout} {kind}")
