"""DataParallelStrategy: Lightning's DDPStrategy, with a user's own DataLoaders kept in the one-process order."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_dist import _compat
from lightning_dist.parallel.clip import global_grad_norm
from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.strategies.guard import GuardedStrategyMixin
from lightning_dist.strategies.loaders import LoaderOrderMixin


class DataParallelStrategy(GuardedStrategyMixin, LoaderOrderMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` (its C++ reducer, its hooks), except for data order: a loader's own sampler is
    dealt out by rank (global batch k = one process's batch k at world-size x the batch) instead of being replaced
    by a shuffling ``DistributedSampler``. The app's ``parallelism=ddp``.
    """

    strategy_name = "data_parallel"

    def __init__(
        self, *args: Any, options: ParallelOptions | None = None, on_nonfinite: str | None = None, **kwargs: Any
    ) -> None:
        # Of the layout options, Lightning's DDP takes the non-finite guard and the process-group settings.
        fields = {"on_nonfinite": on_nonfinite} if on_nonfinite is not None else {}
        self.options = ParallelOptions.build(options, **fields)
        kwargs.setdefault("process_group_backend", self.options.process_group_backend)
        kwargs.setdefault("timeout", self.options.timeout)
        super().__init__(*args, **kwargs)

    @override
    def setup_environment(self) -> None:
        _compat.init_after_torchrun_restart(self)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.take_over_loaders(trainer)
        super().setup(trainer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()
        norm = global_grad_norm(self.lightning_module.parameters())  # all-reduced gradients: the same on every rank
        apply = partial(super().optimizer_step, optimizer, lambda: loss, model, **kwargs)
        return self.nonfinite_guard.optimizer_step(optimizer, norm, loss, self.lightning_module, apply)
