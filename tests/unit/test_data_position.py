"""The data position is saved in samples: a resume that changes the global batch (``resume_allow_changes=true``) goes on
with the rest of the interrupted epoch, no sample skipped or read twice, then the next epochs as a run with the new
batch reads them. Through Lightning's own loop and checkpoint flow (``RunCheckpoints``, ``Trainer.fit(ckpt_path=)``),
one process: what a rank sees of it."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import quiet_trainer

from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.data import DataConfig, TokenDataModule
from lightning_dist.data.synthetic import SyntheticDataset

SIZE = 512  # samples of the epoch, as in the probe


class Recorder(pl.LightningModule):
    """A one-parameter model that notes each step's samples (as rows of inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.steps: list[list[tuple[int, ...]]] = []

    def training_step(self, batch, batch_idx):
        inputs, _ = batch
        self.steps.append([tuple(row) for row in inputs.tolist()])
        return self.w * inputs.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(global_batch: int, micro: int | None = None) -> TokenDataModule:
    cfg = DataConfig(global_batch_size=global_batch, seq_len=16, vocab_size=64, num_train_samples=SIZE)
    if micro is not None:
        cfg.micro_batch_size = micro
    return TokenDataModule(cfg, seed=5)


def _fit(data: TokenDataModule, max_steps: int, ckpt_path: Path | None, callbacks=(), accumulate: int = 1):
    module = Recorder()
    trainer = quiet_trainer(
        "auto", 1, max_steps, callbacks, limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=accumulate
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer


def _index_of(data: TokenDataModule) -> dict[tuple[int, ...], int]:
    data.setup()
    dataset: SyntheticDataset = data.dataset("train")
    found = {tuple(dataset[i][0].tolist()): i for i in range(len(dataset))}
    assert len(found) == len(dataset)  # every sample told apart by its tokens
    return found


def _indices(module: Recorder, index: dict[tuple[int, ...], int], accumulate: int = 1) -> list[list[int]]:
    """Each optimizer step's samples (the ``accumulate`` loader batches of one step together)."""
    batches = [[index[row] for row in step] for step in module.steps]
    return [[i for batch in batches[s : s + accumulate] for i in batch] for s in range(0, len(batches), accumulate)]


@pytest.mark.parametrize(
    ("before", "after"),
    [((8, None, 1), (16, None, 1)), ((16, None, 1), (8, None, 1)), ((8, 2, 4), (8, 4, 2))],
    ids=["batch 8 -> 16", "batch 16 -> 8", "micro batch 2 -> 4"],
)
def test_a_resume_with_another_batch_neither_skips_nor_repeats_a_sample(before, after, tmp_path: Path) -> None:
    """The probe: batch 8 -> 16 at step 24 left 48 of the epoch's 512 samples untrained, with only a warning."""
    (batch, micro, accumulate), (new_batch, new_micro, new_accumulate) = before, after
    saved_at = 96 // batch  # a checkpoint after 96 samples, mid-epoch
    index = _index_of(_data(batch))
    first, _ = _fit(
        _data(batch, micro),
        saved_at,
        None,
        [RunCheckpoints(tmp_path / "checkpoints", every_n_steps=saved_at, keep_last=1)],
        accumulate,
    )
    checkpoint = tmp_path / "checkpoints" / f"step-{saved_at:08d}"
    rest = (SIZE - 96) // new_batch  # the epoch's rest in new global batches
    resumed, trainer = _fit(_data(new_batch, new_micro), saved_at + rest + 2, checkpoint, accumulate=new_accumulate)
    trained = _indices(first, index, accumulate)
    steps = _indices(resumed, index, new_accumulate)
    epoch = [i for step in trained for i in step] + [i for step in steps[:rest] for i in step]
    assert Counter(epoch) == Counter(range(SIZE))  # every sample of the epoch once
    assert trainer.global_step == saved_at + rest + 2
    fresh, _ = _fit(_data(new_batch, new_micro), SIZE // new_batch + 2, None, accumulate=new_accumulate)
    fresh_steps = _indices(fresh, index, new_accumulate)
    assert steps[rest:] == fresh_steps[SIZE // new_batch :]  # the next epoch: as a run with the new batch reads it


@pytest.mark.parametrize("saved_at", [20, 64], ids=["mid-epoch", "at the epoch's end"])
def test_an_unchanged_resume_reads_what_the_uninterrupted_run_reads(saved_at: int, tmp_path: Path) -> None:
    index = _index_of(_data(8))
    whole, uninterrupted = _fit(_data(8), 70, None)  # across the epoch's end (64 steps)
    _fit(_data(8), saved_at, None, [RunCheckpoints(tmp_path / "checkpoints", every_n_steps=saved_at, keep_last=1)])
    resumed, trainer = _fit(_data(8), 70, tmp_path / "checkpoints" / f"step-{saved_at:08d}")
    assert _indices(resumed, index) == _indices(whole, index)[saved_at:]
    assert trainer.current_epoch == uninterrupted.current_epoch  # Lightning's own count of epochs agrees


def test_the_position_is_saved_in_samples() -> None:
    data = _data(8)
    data.load_state_dict({"global_step": 24, "samples": 192, "epoch": 0, "epoch_samples": 192})
    data.trainer = None
    assert data.position_at(24) == (0, 192) and data.samples_at(24) == 192
    data.cfg.global_batch_size = 16
    assert data.position_at(44) == (1, 0)  # 20 steps of 16: the epoch's 320 samples left
    assert data.position_at(46) == (1, 32) and data.samples_at(46) == 192 + 22 * 16
