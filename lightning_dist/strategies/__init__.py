"""Lightning strategies of lightning-dist, registered under short names in Lightning's StrategyRegistry."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_dist.strategies.tensor_parallel import TensorParallelStrategy

if TYPE_CHECKING:
    from lightning_dist.config import ParallelismConfig, TrainConfig
    from lightning_dist.parallel_dims import ParallelDims

__all__ = ["PipelineParallelStrategy", "TensorParallelStrategy", "build_model_parallel_strategy", "check_layout"]


def _register() -> None:
    if TensorParallelStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            TensorParallelStrategy.strategy_name,
            TensorParallelStrategy,
            description="Tensor parallelism over all devices (sequence + loss parallel)",
        )
    if PipelineParallelStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            PipelineParallelStrategy.strategy_name,
            PipelineParallelStrategy,
            description="Pipeline parallelism (pp=2, 1F1B) with FSDP2 over the remaining devices",
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
    if par.strategy == "pipeline_parallel":
        return PipelineParallelStrategy(
            pp=dims.pp,
            **degrees,
            schedule=par.schedule,
            microbatches=par.microbatches,
            stages_per_rank=par.stages_per_rank,
            split_points=par.split_points,
            sequence_parallel=par.sequence_parallel,
            loss_parallel=par.loss_parallel,
            **common,
        )
    raise ValueError(f"parallelism.strategy={par.strategy!r} is not a model-parallel strategy.")


def check_layout(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Checks of a model-parallel layout against the model, made before any process starts."""
    from lightning_dist.models.gpt_parallel import check_tensor_parallel

    check_tensor_parallel(cfg.model, dims.tp, cfg.data.seq_len, cfg.parallelism.sequence_parallel)
    par = cfg.parallelism
    if par.strategy != "pipeline_parallel":
        return
    from lightning_dist.data import TokenDataModule
    from lightning_dist.parallel import pipeline

    schedule = pipeline.resolve_schedule(par.schedule, par.stages_per_rank)
    num_stages = dims.pp * par.stages_per_rank
    if num_stages > cfg.model.n_layers:
        raise ValueError(
            f"parallelism.pp={dims.pp} x stages_per_rank={par.stages_per_rank} = {num_stages} stages but the model "
            f"has {cfg.model.n_layers} blocks; lower pp / stages_per_rank or raise model.n_layers."
        )
    if cfg.model.tie_embeddings and dims.pp > 1:
        raise ValueError(
            f"parallelism.pp={dims.pp} with model.tie_embeddings=true: the embedding and the head live on different "
            "stages; set model.tie_embeddings=false."
        )
    microbatches = par.microbatches if par.microbatches is not None else num_stages
    pipeline.check_microbatches(schedule, microbatches, dims.pp, par.stages_per_rank)
    per_rank = TokenDataModule.per_rank_batch_size(cfg.data.global_batch_size, dims.dp_size)
    if per_rank % microbatches:
        raise ValueError(
            f"parallelism.microbatches={microbatches} does not divide the per-rank batch {per_rank} "
            f"(data.global_batch_size={cfg.data.global_batch_size} / dp={dims.dp_size}); pick a divisor of {per_rank}."
        )
