"""Unit tests for lightning_dist.data."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_dist.data import DataConfig, MarkovChain, TokenDataModule, build_datamodule
from lightning_dist.data.files import TextDataset, TokenDataset
from lightning_dist.data.synthetic import SyntheticDataset

SMALL = DataConfig(global_batch_size=8, seq_len=6, vocab_size=16, num_train_samples=100, num_val_samples=20)


def _fake_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    """A Trainer whose (Lightning DDP) strategy puts this process at data-parallel ``rank`` of ``num_replicas``."""
    from lightning.pytorch.strategies import DDPStrategy

    class AtRank(DDPStrategy):
        @property
        def distributed_sampler_kwargs(self) -> dict[str, int]:
            return {"num_replicas": num_replicas, "rank": rank}

    return SimpleNamespace(strategy=AtRank())


def _rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    inputs, targets = batch
    return [tuple(r) for r in torch.cat([inputs, targets[:, -1:]], dim=1).tolist()]


# ---------------------------------------------------------------- synthetic


def test_chain_is_deterministic_per_seed() -> None:
    a, b, c = MarkovChain(32, 4, seed=1), MarkovChain(32, 4, seed=1), MarkovChain(32, 4, seed=2)
    np.testing.assert_array_equal(a.transition, b.transition)
    assert not np.array_equal(a.transition, c.transition)
    np.testing.assert_array_equal(a.sample(8, 20, seed=3), b.sample(8, 20, seed=3))
    assert not np.array_equal(a.sample(8, 20, seed=3), a.sample(8, 20, seed=4))


def test_chain_structure() -> None:
    chain = MarkovChain(32, 4, seed=0)
    p = chain.transition
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert ((p > 0).sum(axis=1) == 4).all()
    assert (p[np.arange(32), (np.arange(32) + 1) % 32] > 0).all()  # ring edge keeps it irreducible
    np.testing.assert_allclose(chain.stationary @ p, chain.stationary, atol=1e-12)
    assert chain.stationary.min() > 0
    x = chain.sample(4, 50, seed=0)
    assert x.shape == (4, 50) and x.dtype == np.int64
    assert (p[x[:, :-1], x[:, 1:]] > 0).all()  # only legal transitions


def test_entropy_floor_matches_empirical() -> None:
    chain = MarkovChain(256, 4, seed=0)
    floor = chain.entropy_rate()
    assert 0 < floor < math.log(4)
    x = chain.sample(1000, 1000, seed=7)
    empirical = -np.log(chain.transition[x[:, :-1], x[:, 1:]]).mean()
    assert abs(empirical - floor) / floor < 0.02


def test_synthetic_dataset_splits_and_shift() -> None:
    chain = MarkovChain(16, 3, seed=0)
    train = SyntheticDataset(chain, 10, 5, "train", seed=0)
    val = SyntheticDataset(chain, 10, 5, "val", seed=0)
    again = SyntheticDataset(chain, 10, 5, "train", seed=0)
    assert len(train) == 10
    inputs, targets = train[3]
    assert inputs.dtype == torch.int64 and inputs.shape == (5,)
    assert torch.equal(inputs[1:], targets[:-1])
    assert torch.equal(train.tokens, again.tokens)
    assert not torch.equal(train.tokens, val.tokens)


def test_synthetic_datamodule_seed() -> None:
    a, b = build_datamodule(SMALL, seed=0), build_datamodule(SMALL, seed=1)
    assert not torch.equal(a.dataset("train").tokens, b.dataset("train").tokens)
    pinned = build_datamodule(replace(SMALL, seed=5), seed=0)
    assert torch.equal(
        pinned.dataset("train").tokens, build_datamodule(replace(SMALL, seed=5), 9).dataset("train").tokens
    )
    assert a.vocab_size == 16
    assert a.loss_floor == pytest.approx(a.chain.entropy_rate())


# ---------------------------------------------------------------- text


def test_text_dataset(tmp_path: Path) -> None:
    data = bytes(b or 1 for b in range(256)) * 4  # 1024 bytes of every value but NUL (a NUL marks a binary file)
    (tmp_path / "a.txt").write_bytes(data[:500])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(data[500:])
    assert TextDataset(str(tmp_path / "*.txt"), "train", 9, 0.2).data.size == 400  # non-recursive glob: a.txt
    for path in (tmp_path, tmp_path / "**" / "*.txt"):
        train = TextDataset(str(path), "train", seq_len=9, val_fraction=0.25)
        val = TextDataset(str(path), "val", seq_len=9, val_fraction=0.25)
        assert train.data.size == 768 and val.data.size == 256
        assert len(train) == 76 and len(val) == 25
        inputs, targets = train[1]
        assert inputs.tolist() == list(data[10:19]) and targets.tolist() == list(data[11:20])
        assert val[0][0].tolist() == list(data[768:777])
    single = TextDataset(str(tmp_path / "a.txt"), "train", seq_len=9, val_fraction=0.2)
    assert single.data.size == 400
    dm = build_datamodule(DataConfig(kind="text", path=str(tmp_path), seq_len=9, global_batch_size=4), seed=0)
    assert dm.vocab_size == 256 and dm.loss_floor is None
    assert next(iter(dm.train_dataloader()))[0].shape == (4, 9)


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.path is None"):
        TextDataset(None, "train", 8)
    with pytest.raises(FileNotFoundError, match=r"data.path='.*nope.txt' matched no file"):
        TextDataset(str(tmp_path / "nope.txt"), "train", 8)
    with pytest.raises(FileNotFoundError, match=r"matched no file"):
        TextDataset(str(tmp_path / "*.md"), "train", 8)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds only empty files"):
        TextDataset(str(tmp_path / "empty.txt"), "train", 8)
    (tmp_path / "short.txt").write_bytes(b"x" * 50)
    with pytest.raises(ValueError, match=r"text split 'val' .* has 5 bytes, fewer than seq_len\+1=9"):
        TextDataset(str(tmp_path / "short.txt"), "val", 8, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"data.val_fraction=1.5"):
        TextDataset(str(tmp_path / "short.txt"), "train", 8, val_fraction=1.5)


# ---------------------------------------------------------------- tokens


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_dataset(tmp_path: Path, dtype: str) -> None:
    big = 70_000 if dtype == "uint32" else 60_000  # uint32 ids beyond the uint16 range
    train = (np.arange(100) + big).astype(dtype)
    train.tofile(tmp_path / "train.bin")
    np.arange(30, dtype=dtype).tofile(tmp_path / "val.bin")
    ds = TokenDataset(str(tmp_path), "train", seq_len=9, dtype=dtype)
    assert len(ds) == 10
    inputs, targets = ds[2]
    assert inputs.dtype == torch.int64
    assert inputs.tolist() == list(range(big + 20, big + 29)) and targets.tolist() == list(range(big + 21, big + 30))
    assert len(TokenDataset(str(tmp_path), "val", seq_len=9, dtype=dtype)) == 3

    ds[0]  # opens the memmap
    assert pickle.loads(pickle.dumps(ds))[2][0].tolist() == inputs.tolist()  # re-maps after pickling


def test_token_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.path is None"):
        TokenDataset(None, "train", 8)
    with pytest.raises(FileNotFoundError, match=r"is not a directory"):
        TokenDataset(str(tmp_path / "missing"), "train", 8)
    with pytest.raises(FileNotFoundError, match=r"train.bin' does not exist"):
        TokenDataset(str(tmp_path), "train", 8)
    with pytest.raises(ValueError, match=r"data.token_dtype='int8' is unsupported"):
        TokenDataset(str(tmp_path), "train", 8, dtype="int8")
    (tmp_path / "train.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"not a multiple of uint16"):
        TokenDataset(str(tmp_path), "train", 8)
    np.zeros(5, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"has 5 tokens, fewer than seq_len\+1=9"):
        TokenDataset(str(tmp_path), "train", 8)
    (tmp_path / "train.bin").write_bytes(b"")  # an empty token shard: said as such
    with pytest.raises(ValueError, match=rf"^'{tmp_path / 'train.bin'}' is empty; data.path=.* must hold train.bin"):
        TokenDataset(str(tmp_path), "train", 8)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match=r"data.kind='csv' is unknown"):
        TokenDataModule(DataConfig(kind="csv"))
    with pytest.raises(ValueError, match=r"data.branching=20"):
        TokenDataModule(DataConfig(vocab_size=16, branching=20))


# ---------------------------------------------------------------- batching / data parallel


def test_per_rank_batch_size() -> None:
    assert TokenDataModule.per_rank_batch_size(32, 4) == 8
    assert TokenDataModule.per_rank_batch_size(32, 1) == 32
    with pytest.raises(ValueError, match=r"data.global_batch_size=30 is not divisible by the data-parallel size 4"):
        TokenDataModule.per_rank_batch_size(30, 4)
    with pytest.raises(ValueError, match=r"data.global_batch_size=2 is not divisible"):
        TokenDataModule.per_rank_batch_size(2, 4)


def test_dataloaders_use_trainer_dp_coordinates() -> None:
    dm = build_datamodule(SMALL, seed=0)
    assert dm.data_parallel_info() == (1, 0)  # no trainer
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace())  # single-device strategy: no sampler kwargs
    assert dm.data_parallel_info() == (1, 0)
    dm.trainer = _fake_trainer(2, 1)
    loader = dm.train_dataloader()
    assert loader.batch_size == 4 and loader.drop_last
    inner = loader.sampler.sampler  # the DistributedSampler inside the step-driven wrapper
    assert (inner.num_replicas, inner.rank, inner.shuffle) == (2, 1, True)
    val = dm.val_dataloader()
    assert not val.sampler.shuffle and len(val.sampler) == 10
    # Tensor-parallel peers share a data-parallel coordinate and must see identical batches.
    peer = build_datamodule(SMALL, seed=0)
    peer.trainer = _fake_trainer(2, 1)
    for a, b in zip(loader, peer.train_dataloader(), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    dm.trainer = _fake_trainer(3, 0)
    with pytest.raises(ValueError, match=r"data.global_batch_size=8 is not divisible by the data-parallel size 3"):
        dm.train_dataloader()


@pytest.mark.parametrize("num_train", [96, 100])  # a multiple of the global batch and not
def test_dp_equivalence(num_train: int) -> None:
    cfg = replace(SMALL, num_train_samples=num_train)
    dm = build_datamodule(cfg, seed=3)

    def run(num_replicas: int, rank: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        loader = dm.build_dataloader("train", num_replicas, rank)
        for _ in range(epoch):  # every pass over the train loader serves the next epoch
            list(loader)
        return list(loader)

    for epoch in (0, 1):
        reference = run(1, 0, epoch)
        assert len(reference) == num_train // cfg.global_batch_size
        for n in (1, 2, 4):
            steps = [run(n, r, epoch) for r in range(n)]
            assert all(len(s) == len(reference) for s in steps)
            for k, ref_batch in enumerate(reference):
                union = sorted(row for s in steps for row in _rows(s[k]))
                assert union == sorted(_rows(ref_batch)), f"n={n} epoch={epoch} step={k}"
    assert not torch.equal(run(1, 0, 0)[0][0], run(1, 0, 1)[0][0])  # epochs reshuffle


def test_resume_mid_epoch_continues_the_same_stream() -> None:
    """A run resumed at step k (Lightning restores the datamodule's state) sees what step k+1.. would have."""
    dm = build_datamodule(replace(SMALL, num_train_samples=96), seed=3)
    loader = dm.build_dataloader("train", 2, 1)
    stream = list(loader) + list(loader)  # two epochs of 12 steps
    for step in (5, 12, 17):
        resumed = build_datamodule(replace(SMALL, num_train_samples=96), seed=3)
        resumed.load_state_dict({"global_step": step})
        rest = list(resumed.build_dataloader("train", 2, 1))
        assert len(rest) == 12 - step % 12
        for a, b in zip(rest, stream[step:], strict=False):
            assert torch.equal(a[0], b[0])


def test_data_beyond_the_vocabulary_or_binary_as_text_fails_before_launch(tmp_path: Path) -> None:
    from helpers import FAST, compose_config

    from lightning_dist.config.validate import validate

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    np.arange(300, dtype=np.uint16).tofile(tokens / "train.bin")  # ids up to 299 with data.vocab_size=256
    np.arange(100, dtype=np.uint16).tofile(tokens / "val.bin")
    with pytest.raises(ValueError, match=r"train.bin' holds token id 299, beyond data.vocab_size=256; set data.vocab"):
        validate(compose_config([*FAST, "data=tokens", f"data.path={tokens}", "data.seq_len=8", "data.vocab_size=256"]))
    (tmp_path / "model.bin").write_bytes(b"weights\x00\x01" * 100)
    with pytest.raises(ValueError, match=r"model.bin' is binary \(a NUL byte at offset 7\); data=text reads text"):
        validate(compose_config([*FAST, "data=text", f"data.path={tmp_path / 'model.bin'}"]))
