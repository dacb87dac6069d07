"""Lightning strategies of lightning-dist, registered under short names in Lightning's StrategyRegistry."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.data_parallel import DataParallelStrategy
from lightning_dist.strategies.mesh import MeshStrategy
from lightning_dist.strategies.presets import PipelineParallelStrategy, TensorParallelStrategy

__all__ = [
    "DataParallelStrategy",
    "MeshStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
]

#: Short name -> (strategy, description). ``"fsdp2"`` because Lightning's own ``"fsdp"`` is FSDP1 (its FSDPStrategy).
_REGISTERED = {
    MeshStrategy.strategy_name: (MeshStrategy, "Any (pp, dp_replicate, dp_shard, cp, tp) mesh; default FSDP2 on all"),
    "fsdp2": (MeshStrategy, "FSDP2 (torch fully_shard) over all devices; Lightning's 'fsdp' is FSDP1"),
    TensorParallelStrategy.strategy_name: (TensorParallelStrategy, "Tensor parallelism over all devices (SP + LP)"),
    PipelineParallelStrategy.strategy_name: (PipelineParallelStrategy, "Pipeline (pp=2, 1F1B), FSDP2 over the rest"),
}
for _name, (_strategy, _description) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _strategy, description=_description)
