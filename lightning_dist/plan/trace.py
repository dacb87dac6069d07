"""One rank of a real-size layout, traced on this machine: the model on the meta device, torch's fake process-group
backend for the world, and the strategy's own parallelize path (TP, activation checkpointing, FSDP2, pipeline
split). Nothing is allocated and no collective runs; what the rank would hold is read from its shards' shapes.

Run it in a fresh process (it initializes ``torch.distributed``), e.g. with :func:`lightning_dist.launch.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_dist.config import TrainConfig


@dataclass(frozen=True)
class RankTrace:
    """What one rank holds after parallelizing: its parameters (local shards) and its pipeline stages."""

    rank: int
    coordinates: dict[str, int]
    local_params: int
    param_bytes: int
    stage_ids: list[int]
    microbatches: int | None


def trace_rank(cfg: TrainConfig, rank: int) -> RankTrace:
    """Parallelize ``cfg``'s model as rank ``rank`` of its full world size would, without allocating it.

    The layout comes from ``cfg`` exactly as for training (``cluster.devices x cluster.num_nodes`` ranks); the data
    is not read, so a recipe naming files that are not on this machine traces too.
    """
    import torch.distributed as dist
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_dist import _compat
    from lightning_dist.app import build_parallel_dims, build_strategy
    from lightning_dist.builders import build_module, resolve_micro_batch

    dims = build_parallel_dims(cfg)
    per_rank = cfg.data.global_batch_size // dims.dp_size
    resolve_micro_batch(cfg, dims, per_rank)
    _compat.init_fake_process_group(rank, dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")
        module = build_module(cfg)
        strategy = build_strategy(cfg, dims)
        environment = LightningEnvironment()
        environment.set_world_size(dims.world_size)
        environment.set_global_rank(rank)
        strategy.cluster_environment, strategy.parallel_devices = environment, [torch.device("cpu")]
        if cfg.cluster.precision == "bf16-mixed":
            strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
        _compat.set_device_mesh(strategy, module, mesh)
        with torch.device("meta"):
            module.configure_model()
        strategy._parallelize(module, materialize=False)
        pipeline = strategy.pipeline
        params = {id(p): p for p in module.parameters()}.values()
        return RankTrace(
            rank=rank,
            coordinates=dims.coordinates(rank),
            local_params=sum(_local(p).numel() for p in params),
            param_bytes=sum(_local(p).numel() * p.element_size() for p in params),
            stage_ids=pipeline.stage_ids if pipeline is not None else [0],
            microbatches=pipeline.microbatches if pipeline is not None else None,
        )
    finally:
        dist.destroy_process_group()


def _local(param: Any) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
