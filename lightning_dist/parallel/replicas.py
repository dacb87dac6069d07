"""The replica axis made fault tolerant with torchft: replica groups that keep training when one of them is lost.

Under ``parallelism.replicas.recovery=torchft`` each of the ``dp_replicate`` replica groups is a job of its own (its
ranks lay the model out over the other axes, as ``dp_replicate=1`` would), and the groups meet through torchft
(PyTorch's per-step fault tolerance, github.com/pytorch/torchft): a Lighthouse tracks the healthy groups,
and every rank runs a ``torchft.Manager`` that, at the start of each step, joins the quorum of the groups alive; the
step's gradients are averaged over the groups in the quorum through torchft's reconfigurable process group; and the
optimizer step is committed only when every group in the quorum finished its part (``should_commit``). A group that
dies leaves the quorum (after the Lighthouse's heartbeat timeout) and the others go on with the global batch less
its share; a group that comes back (a fresh job, or one that failed a step) is behind, and torchft copies a healthy
peer's state to it before it steps again: the parameters and optimizer state of this rank's shard (rank ``i`` of
every group holds the same shard, so the copy is rank to rank), the LR schedulers, and for a fresh job the loop's
position (:meth:`FaultTolerantReplicas.recover`), so it reads its share of the same global batches as its peers.

No Lightning here: the strategy hands the states over as callables.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_dist.errors import LightningDistError
from lightning_dist.parallel.options import ReplicaOptions

#: The ``ckpt_path`` a restarted replica group starts from: its checkpoint is a healthy peer's live state, not a file.
FROM_PEER = "torchft:peer"
log = logging.getLogger("lightning_dist")
#: What the Telemetry logs of the replica axis (``replicas/``), each step's values at its logging steps.
REPLICA_KEYS = ("replicas/participants", "replicas/recoveries", "replicas/missed_steps")


class ReplicaQuorumLostError(LightningDistError, RuntimeError):
    """Fewer replica groups than ``parallelism.replicas.min_replicas`` answered for longer than the quorum timeout.

    Restarting the group repeats it: the groups that are gone stay gone."""

    restart_would_repeat = True


def torchft_available() -> bool:
    """Whether torchft is installed (found, not imported)."""
    return importlib.util.find_spec("torchft") is not None


class FaultTolerantReplicas:
    """This rank's part of the fault-tolerant replica axis: its torchft ``Manager`` and the step's three moments.

    Args:
        options: ``parallelism.replicas``.
        group: This replica group's index (``0 .. groups - 1``).
        groups: The replica groups of the job (``dp_replicate``).
        group_rank: This rank's index inside its group.
        group_size: Ranks per group.
        state: The rank's state a peer copies from it: ``{"tensors": {name: tensor}, "extra": ...}`` (tensors of this
            rank's shard; the same names, shapes and layout on every group's rank at this position).
        load_state: Takes a peer's ``state()`` in place.
        timeout: The collectives' and recovery's timeout.
    """

    def __init__(
        self,
        options: ReplicaOptions,
        group: int,
        groups: int,
        group_rank: int,
        group_size: int,
        state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
        timeout: timedelta,
    ) -> None:
        from torchft import Manager, ProcessGroupGloo  # optional: lightning-dist[ft]

        self.options, self.group, self.groups = options, group, groups
        self._load_state = load_state
        self.recoveries = 0  #: times this group took a peer's state
        self.missed_steps = 0  #: steps this group was behind its peers, summed over its recoveries
        self.last_recovery: dict[str, Any] | None = None  #: the state of the latest recovery (``extra`` included)
        self.manager_rank = group_rank
        self._in_step = False
        self._started = False  # every group met once (a fresh job's first step)
        self._participants: int | None = None
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._take_state,
            state_dict=state,
            min_replica_size=options.min_replicas,
            use_async_quorum=False,  # the quorum (and any recovery) before the step: a rejoined group steps in place
            replica_id=f"replica-group-{group}",
            rank=group_rank,
            world_size=group_size,
            lighthouse_addr=options.lighthouse,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
            connect_timeout=timeout,
        )

    # --------------------------------------------------------------------------------------------- the step
    def begin_step(self) -> None:
        """Join this step's quorum (once per optimizer step); a group behind its peers takes a healthy one's state
        first.

        Raises:
            ReplicaQuorumLostError: Fewer than ``min_replicas`` groups answered within the quorum timeout.
        """
        if self._in_step:
            return
        before = self.manager.current_step()
        self._quorum()
        # A fresh job starts with every group: the first to come up would otherwise train alone until the others
        # join, and they would then skip the steps it took.
        deadline = time.monotonic() + self.options.quorum_timeout_s
        while not self._started and self.participants < self.groups:
            if time.monotonic() > deadline:
                raise ReplicaQuorumLostError(
                    f"replica group {self.group}: only {self.participants} of {self.groups} replica groups started "
                    f"within parallelism.replicas.quorum_timeout_s={self.options.quorum_timeout_s:g}; start every "
                    "group (each its own job under torchrun / srun) against the same Lighthouse."
                )
            time.sleep(0.1)
            self._quorum()
        self._started = True
        if self.manager.current_step() > before:  # recovered: the peers' step
            self.missed_steps += self.manager.current_step() - before
        participants = self.participants
        if participants != self._participants and self._participants is not None and self.manager_rank == 0:
            log.warning(
                "replica group %d, step %d: %d of %d replica groups in the quorum (were %d)",
                self.group,
                self.manager.current_step() + 1,
                participants,
                self.groups,
                self._participants,
            )
        self._participants = participants
        self._in_step = True

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as err:  # torchft raises its RPC's timeout as a plain exception
            raise ReplicaQuorumLostError(
                f"replica group {self.group}: no quorum of parallelism.replicas.min_replicas="
                f"{self.options.min_replicas} of {self.groups} groups within {self.options.quorum_timeout_s:g} s "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'timeout'}); the job stops: too "
                "few replica groups are left to train."
            ) from None

    def average_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Average this rank's gradients (its shards) over the groups in the quorum: one all-reduce per dtype."""
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()  # sum / participants (a group not taking part sends zeros)
            offset = 0
            for grad in same:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def should_commit(self) -> bool:
        """Whether every group in the quorum finished the step (all of this group's ranks agree): only then is the
        optimizer step applied."""
        self._in_step = False
        return bool(self.manager.should_commit())

    def mean(self, tensor: Tensor) -> Tensor:
        """``tensor`` averaged over the groups in the quorum (a logged value: it is read anyway)."""
        if not torch.is_floating_point(tensor):
            return tensor
        out = tensor.detach().clone()
        self.manager.allreduce(out).wait()
        return out

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum."""
        return self.manager.num_participants()

    def metrics(self) -> dict[str, float]:
        """``replicas/`` values for the telemetry (:data:`REPLICA_KEYS`)."""
        return {
            "replicas/participants": float(self.participants),
            "replicas/recoveries": float(self.recoveries),
            "replicas/missed_steps": float(self.missed_steps),
        }

    # --------------------------------------------------------------------------------------------- recovery
    def recover(self) -> dict[str, Any] | None:
        """A fresh group's start: join the quorum now (before the training loop) and take a healthy peer's state
        when behind; returns that state's ``extra`` (the peers' loop position), or ``None`` when no peer was ahead."""
        recovered = self.recoveries
        self._started = True  # the peers are training already: no wait for every group
        # This quorum is also the first step's: the peers, in step already, wait for this group's gradients of it.
        self.begin_step()
        return self.last_recovery.get("extra") if self.recoveries > recovered and self.last_recovery else None

    def _take_state(self, state: dict[str, Any]) -> None:
        self.recoveries += 1
        self.last_recovery = state
        self._load_state(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def shard_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Tensor | float | int]:
    """This rank's parameters, buffers and optimizer state as plain tensors of its shard, by name (what a peer copies:
    the same names and local shapes at the same position of every group)."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, Any] = {f"param/{name}": _local(p).detach() for name, p in model.named_parameters()}
    out.update({f"buffer/{name}": _local(b).detach() for name, b in model.named_buffers()})
    for index, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            for key, value in values.items():
                out[f"optim{index}/{names[id(param)]}/{key}"] = _local(value) if isinstance(value, Tensor) else value
        for number, group in enumerate(optimizer.param_groups):  # the LR the scheduler set, and the like
            out.update({f"group{index}/{number}/{k}": v for k, v in group.items() if k != "params"})
    return out


def load_shard_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Copy a peer's :func:`shard_state` into this rank's parameters, buffers and optimizer state, in place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(state[f"param/{name}"])
        for name, buffer in model.named_buffers():
            if f"buffer/{name}" in state:
                _local(buffer).copy_(state[f"buffer/{name}"])
        by_name = dict(model.named_parameters())
        for index, optimizer in enumerate(optimizers):
            for number, group in enumerate(optimizer.param_groups):
                group.update({k: state[f"group{index}/{number}/{k}"] for k in group if k != "params"})
            prefix = f"optim{index}/"
            for key, value in state.items():
                if not key.startswith(prefix):
                    continue
                name, _, field = key[len(prefix) :].rpartition("/")
                param = by_name[name]
                values = optimizer.state.setdefault(param, {})
                values[field] = _like(param, value) if isinstance(value, Tensor) else value


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (a peer's shard of an optimizer state) laid out as ``param``: a DTensor for a sharded parameter."""
    local = local.to(_local(param).device)
    if isinstance(param, DTensor) and local.shape == param.to_local().shape and local.dim() > 0:
        return DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False)
    return local.clone()
