"""lightning-dist: tensor, pipeline and data parallelism for the PyTorch Lightning Trainer."""

from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies import PipelineParallelStrategy, TensorParallelStrategy
from lightning_dist.telemetry import Telemetry

__all__ = ["ParallelDims", "PipelineParallelStrategy", "Telemetry", "TensorParallelStrategy"]
__version__ = "0.1.0"
