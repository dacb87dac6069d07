"""Logged values and torchmetrics metrics count each token once: reduced over the data-parallel and cp ranks only.

Ranks that differ only in their ``tp`` / ``pp`` coordinates read the same batch and log the same values (a pipeline
sends its loss and outputs to every stage). Reducing over every rank, as Lightning and torchmetrics do by default,
would count each sample ``tp x pp`` times in a sum, a count or a concatenation; a mean hides it. The ``cp`` ranks of
one data-parallel rank hold different tokens of the same samples: their values are averaged with the data-parallel
ones (the one-process mean when each holds as many counted tokens; a per-sample count counts a sample ``cp`` times).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from lightning_dist.parallel_dims import ParallelDims


class DataParallelMetrics:
    """A strategy's ``sync_dist`` and torchmetrics metrics reduced over its data-parallel (and cp) ranks only (a
    member of :class:`~lightning_dist.strategies.mesh.MeshStrategy`).

    Args:
        dims: The layout (its mesh built).
    """

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self._changed: list[Metric] = []

    @cached_property
    def dp_group(self) -> torch.distributed.ProcessGroup:
        """This rank's data-parallel process group (``dp_replicate`` x ``dp_shard``, x ``cp``): the ranks with other
        tokens."""
        return self.dims.group(self.dims.loss_axis)

    def reduce(self, tensor: Any, group: Any, reduce_op: Any, reduce: Callable[..., Any]) -> Any:
        """Lightning's ``sync_dist`` (``reduce``: the strategy's own reduction): over the data-parallel group unless
        ``group`` is given (nothing to reduce at ``dp = 1``)."""
        if isinstance(tensor, DTensor):  # the loss of a loss-parallel step is a replicated DTensor
            tensor = tensor.full_tensor()
        if group is None and self.dims.model_parallel_size > 1:
            if self.dims.dp_cp_size == 1:
                return tensor  # every rank holds the same batch: nothing to reduce
            group = self.dp_group
        return reduce(tensor, group=group, reduce_op=reduce_op)

    def sync_over_data_parallel(self, module: torch.nn.Module) -> None:
        """Make each torchmetrics ``Metric`` of ``module`` that syncs over all ranks sync over the ``dp`` group, until
        :meth:`restore` puts them back (the module may be used next under another layout)."""
        self.restore()  # setup runs again for validate / test / predict
        if self.dims.model_parallel_size == 1:
            return
        for metric in module.modules():
            # process_group None: torchmetrics' world group; a group or gather function of the user's is kept.
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                self._changed.append(metric)
                if self.dims.dp_cp_size == 1:
                    metric.dist_sync_fn = _own_states  # every rank holds the same samples: nothing to gather
                else:
                    metric.process_group = self.dp_group

    def restore(self) -> None:
        """Give the metrics changed by :meth:`sync_over_data_parallel` their defaults back."""
        for metric in self._changed:
            metric.process_group, metric.dist_sync_fn = None, None
        self._changed = []


def _own_states(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """A torchmetrics ``dist_sync_fn`` that gathers nothing: this rank's state is the whole state."""
    return [tensor]
