"""Logged values and torchmetrics metrics count each token once: reduced over the data-parallel and cp ranks only.

Ranks that differ only in their ``tp`` / ``pp`` coordinates read the same batch and log the same values (a pipeline
sends its loss and outputs to every stage). Reducing over every rank, as Lightning and torchmetrics do by default,
would count each sample ``tp x pp`` times in a sum, a count or a concatenation; a mean hides it. The ``cp`` ranks of
one data-parallel rank hold different tokens of the same samples: their values are averaged with the data-parallel
ones (the one-process mean when each holds as many counted tokens; a per-sample count counts a sample ``cp`` times).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from lightning_dist.contract import module_hook
from lightning_dist.parallel_dims import ParallelDims


class DataParallelMetricsMixin:
    """For a Lightning strategy with ``parallel_dims``: ``sync_dist`` and metrics reduce over the ``dp`` group."""

    parallel_dims: ParallelDims
    _changed_metrics: list[Metric]  # set by sync_metrics_over_data_parallel

    @cached_property
    def dp_group(self) -> torch.distributed.ProcessGroup:
        """This rank's data-parallel process group (``dp_replicate`` x ``dp_shard``, x ``cp``): the ranks with other
        tokens."""
        return self.parallel_dims.group(self.parallel_dims.loss_axis)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``sync_dist``: over the data-parallel group unless ``group`` is given (none at ``dp=1``)."""
        if isinstance(tensor, DTensor):  # the loss of a loss-parallel step is a replicated DTensor
            tensor = tensor.full_tensor()
        if group is None and self.parallel_dims.model_parallel_size > 1:
            if self.parallel_dims.dp_cp_size == 1:
                return tensor  # every rank holds the same batch: nothing to reduce
            group = self.dp_group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    def sync_metrics_over_data_parallel(self, module: torch.nn.Module) -> None:
        """Make each torchmetrics ``Metric`` of ``module`` that syncs over all ranks sync over the ``dp`` group, until
        :meth:`teardown` puts them back (the module may be used next under another layout)."""
        self.restore_metrics()  # setup runs again for validate / test / predict
        if self.parallel_dims.model_parallel_size == 1:
            return
        for metric in module.modules():
            # process_group None: torchmetrics' world group; a group or gather function of the user's is kept.
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                self._changed_metrics.append(metric)
                if self.parallel_dims.dp_cp_size == 1:
                    metric.dist_sync_fn = _own_states  # every rank holds the same samples: nothing to gather
                else:
                    metric.process_group = self.dp_group

    def restore_metrics(self) -> None:
        """Give the metrics changed by :meth:`sync_metrics_over_data_parallel` their defaults back."""
        for metric in getattr(self, "_changed_metrics", ()):
            metric.process_group, metric.dist_sync_fn = None, None
        self._changed_metrics = []

    def teardown(self) -> None:
        self.restore_metrics()
        super().teardown()  # type: ignore[misc]


def _own_states(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """A torchmetrics ``dist_sync_fn`` that gathers nothing: this rank's state is the whole state."""
    return [tensor]


def sum_expert_load(module: Any, group: Any = None) -> None:
    """Sum the routers' token counts of ``module`` (its ``expert_parallel_spec().load``) over ``group``, the ranks
    holding other tokens of the step (the data-parallel and cp ranks; tp and pp peers count the same tokens), in one
    all-reduce with no read back to the host; nothing without them. The strategies call it after the step's last
    backward, so the module's ``on_before_optimizer_step`` balances the experts by the global batch's load."""
    hook = module_hook(module, "expert_parallel_spec")
    spec = hook() if hook is not None else None
    tensors = list(spec.load()) if spec is not None and spec.load is not None else []
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, group=group)
    for tensor, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(summed.view_as(tensor))
