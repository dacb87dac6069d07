"""DataParallelSampler: the ranks' batches side by side are the one-process batches, for any sampler."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from lightning_dist.data.samplers import DataParallelSampler, seed_unseeded_shuffle


def _batches(sampler, batch_size: int, drop_last: bool = False) -> list[list[int]]:
    return list(BatchSampler(sampler, batch_size, drop_last))


@pytest.mark.parametrize("size", [64, 70, 66])  # whole global batches; a tail split evenly; a tail left out
@pytest.mark.parametrize("shuffle", [False, True])
def test_global_batch_k_is_the_one_process_batch_k(size: int, shuffle: bool) -> None:
    def sampler():
        return (
            RandomSampler(range(size), generator=torch.Generator().manual_seed(3))
            if shuffle
            else SequentialSampler(range(size))
        )

    one_process = _batches(sampler(), 8)
    per_rank = [_batches(DataParallelSampler(sampler(), 2, 4, rank), 2) for rank in range(4)]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank runs the same number of steps
    for k, rank_batches in enumerate(zip(*per_rank)):
        assert [index for batch in rank_batches for index in batch] == one_process[k]
    assert [len(DataParallelSampler(sampler(), 2, 4, r)) for r in range(4)] == [sum(map(len, b)) for b in per_rank]


def test_a_tail_that_cannot_be_split_fails_training_and_warns_evaluation() -> None:
    sampler = SequentialSampler(range(66))  # 66 = 8 x 8 + 2: two samples over four ranks
    with pytest.raises(ValueError, match=r"the last 2 samples cannot be split evenly over 4 data-parallel ranks"):
        DataParallelSampler.check_tail(sampler, 2, 4, drop_last=False, training=True)
    with pytest.warns(UserWarning, match="Evaluation DataLoader: the last 2 samples"):
        DataParallelSampler.check_tail(sampler, 2, 4, drop_last=False, training=False)
    DataParallelSampler.check_tail(sampler, 2, 4, drop_last=True, training=True)  # one process drops it too


def test_set_epoch_reaches_the_loaders_own_sampler() -> None:
    class Epochs(SequentialSampler):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    inner = Epochs(range(8))
    DataParallelSampler(inner, 2, 2, 0).set_epoch(3)
    assert inner.epoch == 3


def test_an_unseeded_shuffle_gets_the_same_order_on_every_rank() -> None:
    orders = []
    for rank in range(2):
        torch.manual_seed(rank)  # ranks whose global RNG has moved differently
        sampler = RandomSampler(range(16))
        assert seed_unseeded_shuffle(sampler, seed=5)
        orders.append(list(sampler))
    assert orders[0] == orders[1]
    assert not seed_unseeded_shuffle(SequentialSampler(range(4)), seed=5)
