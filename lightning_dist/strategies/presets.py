"""Named presets of :class:`~lightning_dist.strategies.mesh.MeshStrategy`: its defaults for one kind of layout."""

from __future__ import annotations

from typing import Any

from lightning_dist.parallel.options import Parallelism
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
        parallelism: A :class:`~lightning_dist.parallel.options.Parallelism`.
        options: :class:`~lightning_dist.strategies.mesh.MeshStrategy`'s keyword arguments (``sequence_parallel``,
            ``loss_parallel``, ``plan``, ``activation_checkpointing``, ``on_nonfinite``, ...).
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        *,
        parallelism: Parallelism | None = None,
        **options: Any,
    ) -> None:
        super().__init__(dp_replicate, dp_shard, tp, 1, parallelism=parallelism, **options)


class PipelineParallelStrategy(MeshStrategy):
    """Pipeline parallelism with a ``torch.distributed.pipelining`` schedule, inside a normal Lightning loop.

    Example::

        Trainer(strategy=PipelineParallelStrategy(pp=2, tp=1, dp_shard=-1, schedule="1F1B", microbatches=8))
        Trainer(strategy="pipeline_parallel", devices=2)  # after `import lightning_dist`

    The LightningModule keeps its ``training_step`` calling ``self.compute_loss(batch)`` and describes its model
    with ``pipeline_spec()`` (a :class:`~lightning_dist.PipelineSpec`); see
    :class:`~lightning_dist.parallel.pipeline_stages.PipelineStages` for how a step runs. With ``pp=1`` there is
    nothing to pipeline and the whole model is trained as under :class:`~lightning_dist.strategies.mesh.MeshStrategy`.

    Args:
        pp: Pipeline degree (ranks per pipeline).
        tp: Tensor-parallel degree inside each stage.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree; ``-1`` = the rest.
        parallelism: A :class:`~lightning_dist.parallel.options.Parallelism`.
        options: :class:`~lightning_dist.strategies.mesh.MeshStrategy`'s keyword arguments (``schedule``,
            ``microbatches``, ``stages_per_rank``, ``split_points``, ...).
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pp: int = 2,
        tp: int = 1,
        dp_shard: int = -1,
        dp_replicate: int = 1,
        *,
        parallelism: Parallelism | None = None,
        **options: Any,
    ) -> None:
        super().__init__(dp_replicate, dp_shard, tp, pp, parallelism=parallelism, **options)
