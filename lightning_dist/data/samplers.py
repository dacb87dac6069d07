"""Sharding a user's own DataLoader over data-parallel ranks without changing what one process would read.

Lightning's default (``use_distributed_sampler=True``) puts a shuffling ``DistributedSampler`` in front of every
training loader, whatever the loader's own sampler was: a different order than one process, even with one
data-parallel rank. :class:`DataParallelSampler` keeps the loader's own sampler and only deals its index stream out:
each run of ``batch_size x num_replicas`` indices (one global batch) is cut into ``num_replicas`` consecutive chunks,
chunk ``r`` to data-parallel rank ``r``. So global batch ``k`` (the ranks' batches ``k`` side by side) is batch ``k``
of one process whose loader has the global batch size, for sequential, seeded shuffled and any other samplers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler


class DataParallelSampler(Sampler[int]):
    """Rank ``rank``'s share of each global batch of ``sampler``'s indices, in order.

    Fed to a ``BatchSampler`` of the loader's ``batch_size``, every batch it makes is exactly this rank's chunk of one
    global batch. The tail (fewer than a global batch) is split evenly when ``num_replicas`` divides it, and dropped
    otherwise (with ``drop_last`` the loader drops it anyway): ranks must run the same number of steps.

    Args:
        sampler: The loader's own sampler (iterated whole on every rank, so it must give every rank the same order).
        batch_size: The loader's (per-rank) batch size.
        num_replicas: Data-parallel ranks.
        rank: This rank's data-parallel index.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, num_replicas: int, rank: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        step = self.batch_size * self.num_replicas
        chunk: list[int] = []
        for index in self.sampler:
            chunk.append(index)
            if len(chunk) == step:
                yield from chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                chunk = []
        if chunk and len(chunk) % self.num_replicas == 0:
            share = len(chunk) // self.num_replicas
            yield from chunk[self.rank * share : (self.rank + 1) * share]

    def __len__(self) -> int:
        full, tail = divmod(len(self.sampler), self.batch_size * self.num_replicas)  # type: ignore[arg-type]
        return full * self.batch_size + (tail // self.num_replicas if tail % self.num_replicas == 0 else 0)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the loader's own sampler (Lightning calls it at the start of every epoch)."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    @staticmethod
    def check_tail(sampler: Sampler[int], batch_size: int, num_replicas: int, drop_last: bool, training: bool) -> None:
        """Raise (training) or warn (evaluation) when a last partial batch cannot be split evenly over the ranks."""
        if drop_last or not isinstance(sampler, Sized):
            return
        tail = len(sampler) % (batch_size * num_replicas)
        if tail % num_replicas == 0:
            return
        message = (
            f"the last {tail} samples cannot be split evenly over {num_replicas} data-parallel ranks, so they would be "
            f"left out, while one process reads them as a last batch of {tail}; set drop_last=True on the DataLoader "
            f"or use a dataset size whose remainder by {batch_size * num_replicas} is a multiple of {num_replicas}."
        )
        if training:
            raise ValueError(f"Training DataLoader: {message}")
        warnings.warn(f"Evaluation DataLoader: {message}", stacklevel=2)


def seed_unseeded_shuffle(sampler: Any, seed: int) -> bool:
    """Give a ``RandomSampler`` that draws from torch's global RNG a generator seeded with ``seed``; True if it did.

    Ranks of one layout consume the global RNG differently (a pipeline rank initializes only its stages), so an
    unseeded shuffle would give peers that must read the same batches different orders.
    """
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(seed)
        return True
    return False
