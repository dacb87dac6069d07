"""DataParallelSampler: the ranks' batches side by side are the one-process batches, for any sampler."""

from __future__ import annotations

import numpy as np
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


# ------------------------------------------------------------------------------ masked data: the global batch's tokens
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_rank_knows_each_global_batch_and_its_target_tokens(dp: int) -> None:
    """The permutation every rank's DistributedSampler slices is the one-replica sampler's (global_order), the samples
    of step s over all ranks are its block [s*G, (s+1)*G), and StepSampler yields that block's target tokens with every
    index: across epochs and resumed mid-epoch, without communication. Validation batches: the same by global batch."""
    from torch.utils.data import DistributedSampler

    from lightning_dist.data.datamodule import StepSampler
    from lightning_dist.data.token_norm import GlobalBatchTokensSampler, global_order

    size, global_batch, seed = 53, 8, 7  # 53: a tail that no dp divides; drop_last cuts it
    dataset = list(range(size))
    counts = np.random.default_rng(0).integers(1, 30, size)
    per_rank, steps = global_batch // dp, size // global_batch

    def sampler(rank: int, shuffle: bool = True) -> DistributedSampler:
        return DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)

    one = sampler(0) if dp == 1 else DistributedSampler(dataset, 1, 0, True, seed, True)
    reference = StepSampler(one, global_batch, counts)
    one_process = list(reference) + list(reference)  # two epochs of one process
    for epoch in (0, 3):
        samplers = [sampler(rank) for rank in range(dp)]
        for rank, rank_sampler in enumerate(samplers):
            rank_sampler.set_epoch(epoch)
            assert list(rank_sampler) == global_order(rank_sampler)[rank::dp].tolist()
        assert len({tuple(global_order(s)) for s in samplers}) == 1  # every rank computes the same order
    for start in (0, 2, steps + 1):  # a fresh run; resumed mid-epoch; resumed in the second epoch
        epoch, step = divmod(start, steps)
        streams = [StepSampler(sampler(rank), per_rank, counts, epoch, step * global_batch) for rank in range(dp)]
        ranks = [list(s) + list(s) for s in streams]
        for s in range(start, 2 * steps):
            block = one_process[s * global_batch : (s + 1) * global_batch]
            got = [item for stream in ranks for item in stream[(s - start) * per_rank : (s - start + 1) * per_rank]]
            assert sorted(got) == sorted(block)  # the same samples, each with (G, the block's tokens)
            assert {item[1:] for item in got} == {(global_batch, int(counts[[i for i, *_ in block]].sum()))}
    # Evaluation, in order: each index with its global batch of G (the last one shorter) and that batch's tokens
    val = [list(GlobalBatchTokensSampler(sampler(rank, shuffle=False), counts, global_batch)) for rank in range(dp)]
    read = size // dp * dp
    assert sorted(i for stream in val for i, *_ in stream) == list(range(read))
    for index, samples, tokens in (item for stream in val for item in stream):
        block = range(index // global_batch * global_batch, min(read, (index // global_batch + 1) * global_batch))
        assert (samples, tokens) == (len(block), int(counts[list(block)].sum()))
