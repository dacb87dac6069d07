"""One rank of a layout, rehearsed on this machine: real tensors on its one device, torch's fake backend for the rest.

What a layout does to one rank's device does not depend on the values its collectives carry: where each tensor is
placed, what the host waits for, how much memory the rank's shards, activations and optimizer state take. So one
process runs the app's own :func:`~lightning_dist.run.fit.fit` (Lightning's loop, the strategy, the module, the
data, every default callback and the telemetry) as rank ``r`` of a world of ``N``, with every collective answered at
once by torch's ``fake`` process group. The tensors are real and their values are not: a gathered shard holds
whatever the memory held, so a rehearsal skips non-finite updates (``resilience.on_nonfinite=skip``) instead of
stopping. Object collectives (``broadcast_object_list``, ``all_gather_object``, ...) answer with this rank's own
objects, as if every rank had said the same.

A GPU user checks a 64-GPU layout's rank 0 on the one GPU at hand; the test suite runs the first and last rank of
every layout on the CPU (``tests/distributed/test_rehearse.py``), and ``make gpu-check`` on CUDA, with torch's sync
debug mode on the steps that do not log and the peak memory next to the planner's.

Pipelines are not rehearsed yet: torch's schedules agree on their activation shapes by P2P messages between the
stages (``recv_object_list``), which a fake backend cannot carry.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import LightningEnvironment

from lightning_dist import _compat
from lightning_dist.config.schema import TrainConfig
from lightning_dist.config.validate import build_parallel_dims, validate
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.plan.cost import estimate
from lightning_dist.plan.estimate_run import layout_of
from lightning_dist.plan.memory import MemoryEstimate
from lightning_dist.run.fit import fit
from lightning_dist.run.result import RunResult


@dataclass(frozen=True)
class Rehearsal:
    """What one rehearsed rank did: its place in the world, the steps it ran and the memory its device peaked at."""

    rank: int
    world_size: int
    layout: str
    steps: int
    peak_bytes: int | None  # torch.cuda.max_memory_allocated on CUDA; None on the CPU
    result: RunResult


class _OneRankOfMany(LightningEnvironment):
    """Lightning's view of this process: node ``rank`` of ``world_size`` one-device nodes, started from outside."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank

    @property
    def creates_processes_externally(self) -> bool:
        return True  # Lightning launches nothing: this process is the one rank

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self._rank  # Lightning's global rank is node_rank x devices (1) + local_rank (0)


def rehearse(cfg: TrainConfig, rank: int, callbacks: Sequence[pl.Callback] = ()) -> Rehearsal:
    """Run ``cfg``'s training as rank ``rank`` of its world (``cluster.devices x cluster.num_nodes`` ranks) on this
    machine's device, every collective on torch's fake backend.

    Run it in a process of its own (it initializes ``torch.distributed`` and ends it): ``launch(fn, 1, ...)``.

    Args:
        cfg: The run, as for training; its checkpoints, logger and report are off in the rehearsal.
        rank: The rank to be, in ``[0, world)``.
        callbacks: Extra Lightning callbacks (a sync checker, say).

    Raises:
        ValueError: A pipeline layout (one line), or what :func:`~lightning_dist.config.validate.validate` raises.
    """
    world = cfg.cluster.devices * cfg.cluster.num_nodes
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the world of {world} ranks; give a rank in [0, {world - 1}].")
    if cfg.parallelism.pp > 1:
        raise ValueError(
            f"parallelism.pp={cfg.parallelism.pp}: a pipeline cannot be rehearsed on one device yet (torch's schedules "
            "agree on activation shapes over P2P messages, which the fake backend cannot carry); rehearse pp=1."
        )
    cfg = copy.deepcopy(cfg)
    cfg.logger = {}  # no logger
    cfg.trainer.enable_checkpointing = False
    cfg.telemetry.report = False
    cfg.resilience.on_nonfinite = "skip"  # the values are not real: a NaN is no news here
    # One node of `world` devices, as far as the checks go: the Trainer sees one device per node below.
    cfg.cluster.devices, cfg.cluster.num_nodes = world, 1
    valid = validate(cfg, one_rank_here=True)
    # This process is local rank 0 of its own one-device node, whatever launched it (the device mesh reads it).
    os.environ["LOCAL_RANK"] = "0"
    _compat.init_fake_process_group(rank, world)
    cuda = valid.cfg.cluster.accelerator == "gpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with _local_object_collectives():
            placement = {"plugins": [_OneRankOfMany(rank)], "devices": 1, "num_nodes": world}
            result = fit(valid, callbacks=callbacks, placement=placement)
        peak = torch.cuda.max_memory_allocated() if cuda else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return Rehearsal(
        rank=rank, world_size=world, layout=valid.layout, steps=result.steps, peak_bytes=peak, result=result
    )


@contextlib.contextmanager
def _local_object_collectives() -> Iterator[None]:
    """torch's object collectives answered by this rank alone (every rank said what this one says), and every new
    process group on the fake backend.

    The fake backend returns at once from a tensor collective and leaves its output as it was, but an object
    collective unpickles what it received: nothing, on the fake backend. A new group asked for on gloo (Lightning's
    barrier, a background checkpoint writer's) would need a real store, and only gloo has a monitored barrier. These
    are public torch functions and methods, looked up at each call by Lightning and by us."""

    def broadcast_object_list(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
        return None  # this rank's objects stand for the source's

    def all_gather_object(output: list[Any], obj: Any, *args: Any, **kwargs: Any) -> None:
        output[:] = [copy.deepcopy(obj) for _ in output]

    def gather_object(obj: Any, gather_list: list[Any] | None = None, *args: Any, **kwargs: Any) -> None:
        if gather_list is not None:
            gather_list[:] = [copy.deepcopy(obj) for _ in gather_list]

    def scatter_object_list(output: list[Any], inputs: list[Any] | None = None, *args: Any, **kwargs: Any) -> None:
        if inputs:
            output[0] = inputs[0]

    new_group = dist.new_group

    def fake_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        return new_group(*args, **kwargs)  # gloo for Lightning's barrier or a checkpoint writer: the fake one here

    local = {
        "broadcast_object_list": broadcast_object_list,
        "all_gather_object": all_gather_object,
        "gather_object": gather_object,
        "scatter_object_list": scatter_object_list,
        "new_group": fake_group,
    }
    originals = {name: getattr(dist, name) for name in local}
    monitored_barrier = dist.ProcessGroup.monitored_barrier
    for name, function in local.items():
        setattr(dist, name, function)
    dist.ProcessGroup.monitored_barrier = lambda self, *args, **kwargs: None  # Lightning's barrier, on its group
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        dist.ProcessGroup.monitored_barrier = monitored_barrier


def planned_memory(cfg: TrainConfig) -> MemoryEstimate | None:
    """The planner's memory per rank for ``cfg``'s layout, by part (the built-in GPT only; ``None`` otherwise)."""
    if not isinstance(cfg.model, GPTConfig):
        return None
    dims = build_parallel_dims(cfg)
    found = estimate(
        cfg.model,
        layout_of(cfg, dims),
        cfg.hardware,
        cfg.data.seq_len,
        cfg.data.global_batch_size,
        cfg.cluster.precision,
    )
    return found.memory
