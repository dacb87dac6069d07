"""TensorParallelStrategy: the mesh strategy preset for tensor (+ sequence + loss) parallelism inside a node."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_dist.parallel.tensor import TensorParallelPlan
from lightning_dist.strategies.mesh import DEFAULT_TIMEOUT, MeshStrategy


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism (with sequence and loss parallelism) inside, FSDP2 or replication across.

    Example::

        Trainer(strategy=TensorParallelStrategy(tp=2, dp_shard=-1), devices=4)
        Trainer(strategy="tensor_parallel", devices=2)  # after `import lightning_dist`: TP over all devices

    Everything else is :class:`~lightning_dist.strategies.mesh.MeshStrategy`'s.

    Args:
        tp: Tensor-parallel degree; ``-1`` = the devices the data-parallel degrees leave.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree (HSDP when ``dp_shard > 1`` too); ``-1`` = the rest.
        sequence_parallel: Shard norms and residuals along the sequence.
        loss_parallel: Cross-entropy on vocab-sharded logits.
        plan: Module-name pattern -> ``ParallelStyle`` or ``"colwise"`` / ``"rowwise"`` / ``"sequence"``.
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout: a rank that stops answering ends the job after this long.
        options: Other :class:`~lightning_dist.strategies.mesh.MeshStrategy` options: ``activation_checkpointing``,
            ``ac_selective``, ``compile``.
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
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
            pp=1,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            plan=plan,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **options,
        )
