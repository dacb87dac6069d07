"""lightning-dist: tensor, pipeline and data parallelism for the PyTorch Lightning Trainer."""

from lightning_dist.contract import ParallelModule
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_dist.telemetry import Telemetry

__all__ = [
    "MeshStrategy",
    "ParallelDims",
    "ParallelModule",
    "PipelineParallelStrategy",
    "PipelineSpec",
    "Telemetry",
    "TensorParallelStrategy",
]
__version__ = "0.1.0"
