"""Lightning strategies of lightning-dist, registered under short names in Lightning's StrategyRegistry."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.tensor_parallel import TensorParallelStrategy

if TYPE_CHECKING:
    from lightning_dist.config import ParallelismConfig, TrainConfig
    from lightning_dist.parallel_dims import ParallelDims

__all__ = ["TensorParallelStrategy", "build_model_parallel_strategy", "check_layout"]


def _register() -> None:
    if TensorParallelStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            TensorParallelStrategy.strategy_name,
            TensorParallelStrategy,
            description="Tensor parallelism over all devices (sequence + loss parallel)",
        )


_register()


def build_model_parallel_strategy(
    par: ParallelismConfig, dims: ParallelDims, backend: str | None, timeout: timedelta
) -> TensorParallelStrategy:
    """Our strategy for ``parallelism.strategy`` (tensor_parallel or pipeline_parallel) with resolved degrees."""
    common = {"process_group_backend": backend, "timeout": timeout}
    degrees = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
    if par.strategy == "tensor_parallel":
        return TensorParallelStrategy(
            **degrees, sequence_parallel=par.sequence_parallel, loss_parallel=par.loss_parallel, **common
        )
    raise ValueError(f"parallelism.strategy={par.strategy!r} is not a model-parallel strategy.")


def check_layout(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Checks of a model-parallel layout against the model, made before any process starts."""
    from lightning_dist.models.gpt_parallel import check_tensor_parallel

    check_tensor_parallel(cfg.model, dims.tp, cfg.data.seq_len, cfg.parallelism.sequence_parallel)
