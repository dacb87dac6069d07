"""DataParallelStrategy: Lightning's DDPStrategy, with a user's own DataLoaders kept in the one-process order."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_dist.strategies.loaders import LoaderOrderMixin


class DataParallelStrategy(LoaderOrderMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` (its C++ reducer, its hooks), except for data order: a loader's own sampler is
    dealt out by rank (global batch k = one process's batch k at world-size x the batch) instead of being replaced
    by a shuffling ``DistributedSampler``. The app's ``parallelism=ddp``.
    """

    strategy_name = "data_parallel"

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.take_over_loaders(trainer)
        super().setup(trainer)
