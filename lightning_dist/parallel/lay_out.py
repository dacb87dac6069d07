"""Laying a module out over the mesh: the one entry the strategies and the planner call.

A module whose parameters are DTensors already was parallelized by hand (``configure_model`` on
``self.device_mesh``) and is left as it is. Otherwise ``pp > 1`` splits the model into this rank's pipeline stages
(:class:`~lightning_dist.parallel.pipeline_stages.PipelineStages`), each parallelized like a whole model; ``pp = 1``
parallelizes the whole model (:func:`~lightning_dist.parallel.compose.parallelize`). Both then allocate only this
rank's part of a model built on the meta device (:mod:`~lightning_dist.parallel.materialize`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist.parallel.compose import parallelize
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.diloco import describe as describe_diloco
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.parallel.materialize import materialize as materialize_model
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline_stages import PipelineStages
from lightning_dist.parallel_dims import ParallelDims


@dataclass(frozen=True)
class LaidOut:
    """What :func:`lay_out` made of a module on this rank."""

    layout: RankLayout
    """What this rank holds, for people to read (``strategy.describe()``)."""
    pipeline: PipelineStages | None = None
    """This rank's stages and schedule (``pp > 1``)."""


def lay_out(
    module: nn.Module,
    dims: ParallelDims,
    options: Parallelism,
    declared: Declared,
    *,
    rank: int,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    materialize: bool = True,
) -> LaidOut:
    """Lay ``module`` out as rank ``rank`` of ``dims`` holds it (``materialize=False`` leaves a model built on the
    meta device there: a traced rank).

    Args:
        module: The LightningModule (or any module); ``declared`` was read from it.
        dims: The layout; its mesh must be built.
        options: How each axis works.
        declared: What the module declares (:func:`lightning_dist.contract.declared`).
        rank: This process's global rank.
        device: Where this rank's parameters live.
        param_dtype: FSDP2's compute dtype (bf16 under mixed precision).
        materialize: Allocate and initialize this rank's part of a meta-device model.
    """
    sync = describe_diloco(options.diloco) if options.diloco_enabled else ""
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return LaidOut(RankLayout.of(dims, rank, parallelized_by="configure_model", sync=sync))
    if dims.pp_enabled:
        stages = PipelineStages.build(
            module, dims, options, declared, rank, device, param_dtype=param_dtype, materialize=materialize
        )
        return LaidOut(replace(stages.layout, sync=sync), stages)
    done = parallelize(module, dims, options, declared, param_dtype=param_dtype)
    if materialize:
        materialize_model(module, device, declared)  # sharded first: each rank allocates its shards only
    return LaidOut(RankLayout.of(dims, rank, sync=sync, **vars(done)))
