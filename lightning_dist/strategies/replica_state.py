"""What a replica group gives a peer that rejoins, and takes from one: the glue between torchft's recovery
(:mod:`lightning_dist.parallel.replicas`) and Lightning's trainer.

A peer hands over this rank's shard of the parameters, buffers and optimizer state and, beside the tensors, Lightning's
training state (loops, callbacks, datamodule, LR schedulers: :func:`lightning_dist._compat.training_state`). A group
that failed a step and stays alive takes the tensors and the LR schedulers (its loop is in step already); a replaced
group starts its ``fit`` from ``ckpt_path=FROM_PEER``, and :meth:`ReplicaState.checkpoint_from_peer` turns the
peer's state into the checkpoint Lightning restores its loop from, so it reads its share of the same global batch as
its peers from the first step on. No file is read.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from lightning_dist import _compat
from lightning_dist.parallel.replicas import FaultTolerantReplicas, load_shard_state, shard_state, torchft_available
from lightning_dist.parallel_dims import ParallelDims


class ReplicaState:
    """A :class:`~lightning_dist.strategies.mesh.MeshStrategy`'s state as its fault-tolerant replica groups exchange
    it (``strategy``: its model, optimizers and trainer, read when a peer asks, not before)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def start(self, job_dims: ParallelDims, timeout: timedelta) -> FaultTolerantReplicas:
        """This rank's torchft manager for its replica group of ``job_dims`` (after the group's process group).

        Raises:
            ValueError: torchft missing, no replica group given, or no Lighthouse to reach (one line each).
        """
        options = self.strategy.parallelism.replicas
        if not torchft_available():
            raise ValueError(
                "parallelism.replicas.recovery=torchft needs torchft: pip install 'lightning-dist[ft]', or set "
                "parallelism.replicas.recovery=restart."
            )
        if options.group is None:
            raise ValueError(
                "parallelism.replicas.recovery=torchft: this job's replica group is not set; the app's launcher sets "
                "it, under torchrun / srun give parallelism.replicas.group=<0 .. dp_replicate - 1> to each group's job."
            )
        if options.lighthouse is None and "TORCHFT_LIGHTHOUSE" not in os.environ:
            raise ValueError(
                "parallelism.replicas.recovery=torchft: no Lighthouse to join; the app's launcher starts one, under "
                "torchrun / srun start torchft_lighthouse --min_replicas N and give parallelism.replicas.lighthouse="
                "http://<host>:29510."
            )
        dims = self.strategy.parallel_dims
        return FaultTolerantReplicas(
            options,
            group=options.group,
            groups=job_dims.dp_replicate,
            group_rank=self.strategy.global_rank,
            group_size=dims.world_size,
            state=self.state,
            load_state=self.load,
            timeout=timeout,
        )

    def state(self) -> dict[str, Any]:
        """What a rejoining peer copies from this rank (called by torchft when a peer is behind)."""
        strategy = self.strategy
        trainer = strategy.lightning_module.trainer
        return {
            "tensors": shard_state(strategy.model, strategy.optimizers),
            "extra": _compat.training_state(trainer),
        }

    def load(self, state: dict[str, Any]) -> None:
        """Take a peer's :meth:`state` in place: its shard of every tensor and its LR schedulers."""
        strategy = self.strategy
        load_shard_state(strategy.model, strategy.optimizers, state["tensors"])
        trainer = strategy.lightning_module.trainer
        for config, saved in zip(trainer.lr_scheduler_configs, state["extra"]["lr_schedulers"]):
            config.scheduler.load_state_dict(saved)

    def checkpoint_from_peer(self, replicas: FaultTolerantReplicas) -> dict[str, Any]:
        """A replaced group's start: the checkpoint Lightning restores its loop from, a healthy peer's (or, when no
        peer is ahead, this group's own start)."""
        extra = replicas.recover()
        if extra is None:
            return _compat.training_state(self.strategy.lightning_module.trainer)
        return extra
