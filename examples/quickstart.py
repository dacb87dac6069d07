# A model of your own, tensor-parallel over 2 CPU processes: python examples/quickstart.py
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import TensorParallelStrategy
from lightning_dist.callbacks import Preemption


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":  # Lightning runs this file once more for rank 1
    pl.seed_everything(0)
    x = torch.randn(512, 16)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))  # learn y = the sum of x
    data = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    # net.0 split by output features, net.2 by input features; or MeshStrategy(dp_shard=2) for FSDP2
    strategy = TensorParallelStrategy(tp=2, plan={"net.0": "colwise", "net.2": "rowwise"})
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=30, log_every_n_steps=10, callbacks=[Preemption()]
    )
    trainer.fit(Regressor(), data)
    if trainer.is_global_zero:
        print(f"final train/loss: {trainer.callback_metrics['train/loss'].item():.4f}")
