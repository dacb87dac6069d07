"""A checkpoint written by one process (Lightning's single file) resumes under every layout; a checkpoint that cannot
fit the model stops before the first step, naming the tensor."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import FAST, losses, quiet_trainer, run_app
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy
from lightning_dist.run.launch import launch

RUN = [*FAST, "optim.decay_steps=10", "model.n_layers=4", "logger=csv"]
STOP = 5  # of 10 steps
ONE_PROCESS = ["parallelism=ddp", "cluster.devices=1"]  # Lightning's DDP in one process: one .ckpt file
LAYOUTS = {
    "pp2xtp2": ["parallelism=3d", "cluster.devices=4", "parallelism.dp_shard=1"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
    "pp2": ["parallelism=pp", "cluster.devices=2"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """10 steps in one process, uninterrupted, saving Lightning's single file at step 5 on the way."""
    out = tmp_path_factory.mktemp("one")
    saving = ["trainer.enable_checkpointing=true", f"checkpoint.every_n_steps={STOP}"]
    whole = run_app([*RUN, *ONE_PROCESS, *saving], out)
    checkpoint = out / "checkpoints" / f"step-{STOP:08d}"
    assert checkpoint.is_file()  # one file (torch.save), not a sharded folder
    return whole, checkpoint


def _lrs(result: dict) -> dict[int, float]:
    with Path(result["csv"]).open() as file:
        return {int(row["step"]): float(row["train/lr"]) for row in csv.DictReader(file) if row.get("train/lr")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_one_process_checkpoint_resumes_under(layout: str, one_process: tuple[dict, Path], tmp_path: Path) -> None:
    """Model, optimizer (AdamW, two parameter groups), LR schedule, loops and data position carry over."""
    whole, checkpoint = one_process
    resumed = run_app([*RUN, *LAYOUTS[layout], f"ckpt_path={checkpoint}"], tmp_path)
    assert resumed["steps"] == 10
    assert [record["step"] for record in resumed["history"]] == [6.0, 7.0, 8.0, 9.0, 10.0]
    np.testing.assert_allclose(losses(resumed), losses(whole)[STOP:], rtol=1e-5)
    expected = {step: lr for step, lr in _lrs(whole).items() if step >= STOP}
    assert _lrs(resumed) == pytest.approx(expected, rel=1e-6) and len(expected) == 5


def test_another_model_size_stops_before_the_first_step(one_process: tuple[dict, Path], tmp_path: Path) -> None:
    """Checked before launch, for a single file and a sharded folder alike (built-in GPT and model=hf)."""
    _, single_file = one_process
    shape = r"model.tok_emb.weight has shape \(256, 64\) there and \(256, 128\) in the model; set the model config"
    with pytest.raises(ValueError, match=rf"ckpt_path={single_file}: {shape}"):
        run_app([*RUN, "model.d_model=128", f"ckpt_path={single_file}"], tmp_path / "wider")
    sharded = run_app([*RUN, "parallelism=fsdp", "cluster.devices=1", "trainer.max_steps=1",
                       "trainer.enable_checkpointing=true"], tmp_path / "sharded")["checkpoint"]  # fmt: skip
    with pytest.raises(ValueError, match=rf"ckpt_path={sharded} holds model.layers.2.attn_norm.weight \(shape \(64,\)"):
        run_app([*RUN, "model.n_layers=2", f"ckpt_path={sharded}"], tmp_path / "shallower")
    assert not (tmp_path / "wider").exists() and not (tmp_path / "shallower").exists()  # no rank ever started


# ----------------------------------------------------------------------------------- a user's own module
USER_STEPS, USER_STOP = 8, 4
PLAN = {"net.0": "colwise", "net.2": "rowwise"}


class Regressor(pl.LightningModule):
    """A user's module: layers built in ``__init__``, two parameter groups in an order of its own (biases first),
    AdamW and a step LR schedule; trained on one full batch, so every step sees the same data."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, *args) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))
        self.lrs.append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self):
        biases = [p for name, p in self.named_parameters() if name.endswith("bias")]
        weights = [p for name, p in self.named_parameters() if not name.endswith("bias")]
        groups = [{"params": biases, "weight_decay": 0.0}, {"params": weights, "weight_decay": 0.1}]
        optimizer = torch.optim.AdamW(groups, lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loader() -> DataLoader:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.cos().sum(-1)), batch_size=16)


def _resume_under_tp(checkpoint: str) -> dict:
    module = Regressor()
    trainer = quiet_trainer(MeshStrategy(tp=2, dp_shard=1, plan=PLAN), 2, USER_STEPS)
    trainer.fit(module, _loader(), ckpt_path=checkpoint)
    steps, wider, error = trainer.global_step, Regressor(width=32), None
    try:
        trainer = quiet_trainer(MeshStrategy(tp=2, dp_shard=1, plan=PLAN), 2, USER_STEPS)
        trainer.fit(wider, _loader(), ckpt_path=checkpoint)
    except ValueError as err:
        error = str(err)
    return {"losses": module.losses, "lrs": module.lrs, "steps": steps, "error": error,
            "wider_losses": wider.losses}  # fmt: skip


def test_a_users_plain_trainer_checkpoint_resumes_under_tensor_parallelism(tmp_path: Path) -> None:
    """Saved by a plain ``Trainer`` (one process, one file), resumed with ``MeshStrategy(tp=2)``; a module of another
    width is stopped at load time, before its first step, naming the tensor."""
    whole = Regressor()
    saving = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=USER_STOP, save_top_k=-1)
    quiet_trainer("auto", 1, USER_STEPS, callbacks=[saving], enable_checkpointing=True).fit(whole, _loader())
    checkpoint = tmp_path / f"step={USER_STOP}.ckpt"
    for rank in launch(_resume_under_tp, 2, str(checkpoint)):
        assert rank["steps"] == USER_STEPS
        np.testing.assert_allclose(rank["losses"], whole.losses[USER_STOP:], rtol=1e-5)
        assert rank["lrs"] == pytest.approx(whole.lrs[USER_STOP:], rel=1e-6)
        assert rank["error"] == (
            f"checkpoint {checkpoint}: net.0.weight has shape (16, 4) there and (32, 4) in the model; build the "
            "module with the configuration the checkpoint was written with"
        )
        assert rank["wider_losses"] == []
