"""PipelineParallelStrategy: the mesh strategy preset for pipeline parallelism (with TP and FSDP2 / replication)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_dist.parallel.tensor import TensorParallelPlan
from lightning_dist.strategies.mesh import DEFAULT_TIMEOUT, MeshStrategy


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
        schedule: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
            ``ZBVZeroBubble`` or ``DualPipeV``.
        microbatches: Microbatches per step; must divide the per-rank batch. ``None`` = ``pp x stages_per_rank``.
        stages_per_rank: Virtual stages per rank (2+ for the interleaved / looped / V schedules).
        split_points: Block names that start a new stage (``["layers.2"]``); ``None`` = balanced by parameters.
        sequence_parallel: See :class:`~lightning_dist.TensorParallelStrategy`.
        loss_parallel: See :class:`~lightning_dist.TensorParallelStrategy`.
        plan: See :class:`~lightning_dist.TensorParallelStrategy`.
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.
        options: Other :class:`~lightning_dist.strategies.mesh.MeshStrategy` options: ``activation_checkpointing``,
            ``ac_selective``, ``compile``.
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pp: int = 2,
        tp: int = 1,
        dp_shard: int = -1,
        dp_replicate: int = 1,
        schedule: str = "1F1B",
        microbatches: int | None = None,
        stages_per_rank: int = 1,
        split_points: Sequence[str] | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        plan: TensorParallelPlan | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            pp=pp,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            plan=plan,
            schedule=schedule,
            microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            split_points=split_points,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **options,
        )
