"""Lightning strategies of lightning-dist, registered under short names in Lightning's StrategyRegistry."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.data_parallel import DataParallelStrategy
from lightning_dist.strategies.mesh import MeshStrategy
from lightning_dist.strategies.presets import PipelineParallelStrategy, TensorParallelStrategy, build_strategy

__all__ = [
    "DataParallelStrategy",
    "MeshStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "build_strategy",
]

_REGISTERED = {
    TensorParallelStrategy: "Tensor parallelism over all devices (sequence + loss parallel)",
    PipelineParallelStrategy: "Pipeline parallelism (pp=2, 1F1B) with FSDP2 over the remaining devices",
}
for _strategy, _description in _REGISTERED.items():
    if _strategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_strategy.strategy_name, _strategy, description=_description)
