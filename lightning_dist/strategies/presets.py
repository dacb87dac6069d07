"""Named presets of :class:`~lightning_dist.strategies.mesh.MeshStrategy`, and the strategy the app builds for a
``parallelism.strategy`` name."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import Strategy

from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies.data_parallel import DataParallelStrategy
from lightning_dist.strategies.mesh import MeshStrategy


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism (with sequence and loss parallelism) inside, FSDP2 or replication across.

    Example::

        Trainer(strategy=TensorParallelStrategy(tp=2, dp_shard=-1), devices=4)
        Trainer(strategy=TensorParallelStrategy(tp=2, plan={"mlp.fc": "colwise", "mlp.proj": "rowwise"}))
        Trainer(strategy="tensor_parallel", devices=2)  # after `import lightning_dist`: TP over all devices

    Args:
        tp: Tensor-parallel degree; ``-1`` = the devices the data-parallel degrees leave.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree (HSDP when ``dp_shard > 1`` too); ``-1`` = the rest.
        options: A :class:`~lightning_dist.parallel.options.ParallelOptions`.
        option_fields: Single option fields (``sequence_parallel``, ``loss_parallel``, ``plan``,
            ``activation_checkpointing``, ...), set over ``options``.
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        *,
        options: ParallelOptions | None = None,
        **option_fields: Any,
    ) -> None:
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=1, options=options, **option_fields)


class PipelineParallelStrategy(MeshStrategy):
    """Pipeline parallelism with a ``torch.distributed.pipelining`` schedule, inside a normal Lightning loop.

    Example::

        Trainer(strategy=PipelineParallelStrategy(pp=2, tp=1, dp_shard=-1, schedule="1F1B", microbatches=8))
        Trainer(strategy="pipeline_parallel", devices=2)  # after `import lightning_dist`

    The LightningModule keeps its ``training_step`` calling ``self.compute_loss(batch)`` and describes its model
    with ``pipeline_spec()`` (a :class:`~lightning_dist.PipelineSpec`); see
    :class:`~lightning_dist.strategies.stages.PipelineStages` for how a step runs. With ``pp=1`` there is nothing to
    pipeline and the whole model is trained as under :class:`~lightning_dist.strategies.mesh.MeshStrategy`.

    Args:
        pp: Pipeline degree (ranks per pipeline).
        tp: Tensor-parallel degree inside each stage.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree; ``-1`` = the rest.
        options: A :class:`~lightning_dist.parallel.options.ParallelOptions`.
        option_fields: Single option fields (``schedule``, ``microbatches``, ``stages_per_rank``, ``split_points``,
            ...), set over ``options``.
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pp: int = 2,
        tp: int = 1,
        dp_shard: int = -1,
        dp_replicate: int = 1,
        *,
        options: ParallelOptions | None = None,
        **option_fields: Any,
    ) -> None:
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, options=options, **option_fields)


def build_strategy(name: str, dims: ParallelDims, options: ParallelOptions) -> Strategy:
    """The strategy for ``parallelism.strategy=name``: Lightning's DDP (loader order kept) for ``ddp``, else our
    mesh strategy on ``dims``, whose path follows from the degrees alone.

    ``fsdp`` is FSDP2 (torch ``fully_shard``) through the mesh strategy with ``tp=1``: Lightning's FSDPStrategy
    wraps the older FSDP1 and refuses to run on CPU.
    """
    if name == "ddp":
        return DataParallelStrategy(options=options)
    return MeshStrategy(parallel_dims=dims, options=options)
