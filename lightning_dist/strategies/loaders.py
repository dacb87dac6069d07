"""A user's own DataLoaders keep the one-process order under every strategy of ours (Lightning's defaults kept).

Lightning's default (``use_distributed_sampler=True``) replaces a training loader's sampler with a shuffling
``DistributedSampler`` built from the strategy's ``distributed_sampler_kwargs``. Our strategies take that over and
instead deal the loader's own sampler out by data-parallel rank (:class:`~lightning_dist.data.samplers.
DataParallelSampler`), so every layout reads what one process reads.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_dist import _compat
from lightning_dist.data.samplers import DataParallelSampler, seed_unseeded_shuffle


class LoaderDealer:
    """A strategy's loaders dealt out by data-parallel rank (a member of our strategies).

    The strategy calls :meth:`take_over` from its ``setup`` and :meth:`deal` from its ``process_dataloader``.
    """

    def __init__(self) -> None:
        self._shard_loaders = False
        self._taken_over_from: Any = None  # the Trainer whose sampler injection this strategy turned off

    def take_over(self, trainer: Any) -> None:
        """Shard loaders here instead of Lightning, where Lightning would have (``use_distributed_sampler=True``).

        Decided once per Trainer: ``setup`` runs again for ``validate`` / ``test`` / ``predict`` after ``fit``, when
        the Trainer's flag is already off (by us), and those loaders must still be dealt out.
        """
        if self._taken_over_from is not trainer:
            self._shard_loaders = _compat.take_over_distributed_sampler(trainer)
            self._taken_over_from = trainer

    def deal(self, dataloader: object, sampler_kwargs: dict[str, Any], training: bool) -> object:
        """Deal the loader's own index stream out by data-parallel rank (``sampler_kwargs``: the strategy's
        ``distributed_sampler_kwargs``; ``training``: the Trainer is fitting).

        A loader with a ``DistributedSampler`` or an iterable dataset is the user's to shard, and so is every loader
        of a Trainer built with ``use_distributed_sampler=False``.
        """
        if not self._shard_loaders or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader.sampler, DistributedSampler) or has_iterable_dataset(dataloader):
            return dataloader
        if seed_unseeded_shuffle(dataloader.sampler, int(os.environ.get("PL_GLOBAL_SEED", 0))):
            rank_zero_warn(
                "A DataLoader shuffles with torch's global RNG, which ranks of one layout consume differently; "
                "lightning-dist seeded it with the run's seed so every rank reads the same order. Pass "
                "generator=torch.Generator().manual_seed(...) to the DataLoader to choose the order."
            )
        num_replicas, rank = sampler_kwargs["num_replicas"], sampler_kwargs["rank"]
        if num_replicas == 1:
            return dataloader  # tp / pp peers read the same batches: the loader's own order, untouched
        inner = _compat.predict_batch_sampler(dataloader)
        if type(inner) is BatchSampler:  # Lightning's predict loop: deal out the sampler inside its index recorder
            DataParallelSampler.check_tail(inner.sampler, inner.batch_size, num_replicas, inner.drop_last, False)
            share = DataParallelSampler(inner.sampler, inner.batch_size, num_replicas, rank)
            _compat.set_predict_sampler(dataloader, share)
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError(
                f"A DataLoader with a custom batch_sampler ({type(dataloader.batch_sampler).__name__}) cannot be "
                f"sharded over dp={num_replicas} ranks by lightning-dist; give it batch_size= instead, or shard it "
                "yourself (a DistributedSampler with the strategy's distributed_sampler_kwargs) and pass "
                "Trainer(use_distributed_sampler=False)."
            )
        sampler, batch_size = dataloader.sampler, dataloader.batch_size
        DataParallelSampler.check_tail(sampler, batch_size, num_replicas, dataloader.drop_last, training)
        return _compat.update_dataloader(dataloader, DataParallelSampler(sampler, batch_size, num_replicas, rank))
