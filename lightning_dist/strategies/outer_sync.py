"""DiLoCo in the strategy: the outer step after each applied inner step, and each replica's state in checkpoints.

``parallelism.sync=diloco`` (:class:`~lightning_dist.parallel.options.Parallelism`) lays the model out without gradient
synchronization over ``dp_replicate`` (:func:`~lightning_dist.parallel.compose.data_parallel_axes`) and runs
:class:`~lightning_dist.parallel.diloco.DiLoCo` here.

Checkpoints go through the same DCP save and load as every run's (:mod:`lightning_dist.checkpoint.store`), so they
reshard. Replicas hold different parameters and inner optimizer states between outer steps, and DCP keeps one copy of
what looks the same on several ranks (same key, same shard), so replica ``r >= 1`` saves its ``state_dict`` and
``optimizer_<i>`` under the key ``replica<r>``; replica 0's are at the top, where any run keeps them (a resume without
DiLoCo, an export, takes replica 0's). The outer state, the same on every replica, is saved once under ``diloco``
(backup, outer momentum, exchanges in flight), each tensor laid out like its parameter on the replica's inner mesh
(``dp_shard x cp x tp``, pipeline stages), and the position in the H cycle goes into Lightning's own file. So any
inner layout with the same ``dp_replicate`` resumes a checkpoint, mid-cycle too. Another ``dp_replicate`` resumes
one only where the replicas are equal (right after an outer step, nothing in flight): every replica then loads replica
0's. A checkpoint without DiLoCo state (a single file, a run without DiLoCo) starts a fresh outer cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from lightning_dist.checkpoint import full, store
from lightning_dist.parallel.diloco import DiLoCo
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims

#: Mesh axis names that include dp_replicate (the flattened data-parallel axes too).
_REPLICA_AXES = {"dp_replicate", "dp", "data_parallel"}


class OuterSync:
    """DiLoCo in a strategy (:class:`~lightning_dist.strategies.mesh.MeshStrategy` holds one): built with the
    optimizers, counted after each applied inner step (:func:`lightning_dist.parallel.step.optimizer_step`), each
    replica's state in checkpoints. Nothing without ``sync=diloco``.

    Args:
        options: The layout's options (``sync``, ``diloco``).
    """

    def __init__(self, options: Parallelism) -> None:
        self.options = options
        self.diloco: DiLoCo | None = None
        """This rank's :class:`~lightning_dist.parallel.diloco.DiLoCo` (``sync=diloco``, once fitting set up)."""

    def build(self, model: nn.Module, blocks: Sequence[nn.Module], dims: ParallelDims, optimizers: list[Any]) -> None:
        """Start DiLoCo from the current parameters of ``model`` (after the optimizers exist); ``blocks``: the
        module's declared blocks, the fragments' units (a pipeline rank holds some only: split by size there).

        Raises:
            ValueError: Not exactly one optimizer (one inner step per outer count), or a parameter laid out by hand
                over ``dp_replicate`` (its gradients would be averaged every step).
        """
        if not self.options.diloco_enabled:
            return
        if len(optimizers) != 1:
            raise ValueError(
                f"parallelism.sync=diloco counts one inner optimizer step per training step but configure_optimizers "
                f"returned {len(optimizers)} optimizers; use one optimizer or parallelism.sync=every_step."
            )
        # named as in a checkpoint (no wrapper parts): the outer state is saved by name and read back in any layout
        params = [(_fqn(name), p) for name, p in model.named_parameters() if p.requires_grad]
        synced = [name for name, p in params if _REPLICA_AXES & set(_mesh_axes(p))]
        if synced:  # laid out by hand in configure_model over a mesh that averages the replicas every step
            raise ValueError(
                f"parallelism.sync=diloco but {synced[0]} is sharded or replicated over the dp_replicate axis, so its "
                "gradients are averaged every step; shard it over device_mesh['dp_shard'] only, or use "
                "parallelism.sync=every_step."
            )
        names: list[str] = []
        if not dims.pp_enabled:
            by_id = {id(module): name for name, module in model.named_modules()}
            names = [_fqn(f"{by_id[id(b)]}.")[:-1] for b in blocks if id(b) in by_id]
        self.diloco = DiLoCo.build(params, dims.group("dp_replicate"), self.options.diloco, names)

    def replica_state(
        self, state: dict[str, Any], checkpoint: dict[str, Any], dims: ParallelDims, rank: int
    ) -> dict[str, Any]:
        """What this rank gives DCP (``state``: :func:`~lightning_dist.checkpoint.store.sharded_state`): under DiLoCo
        this replica's ``state`` under ``replica<r>`` (r >= 1) and the outer state under ``diloco``; the position in
        the cycle goes into ``checkpoint`` (Lightning's file). ``state`` itself without DiLoCo."""
        if self.diloco is None:
            return state
        replica = dims.coordinates(rank)["dp_replicate"]
        out = {f"replica{replica}": state} if replica else dict(state)
        saved = self.diloco.state_dict()
        step, in_flight = saved.pop("step"), saved.pop("in_flight")
        out["diloco"] = saved
        checkpoint["diloco"] = {
            "replicas": dims.dp_replicate,
            "step": step,
            "in_flight": in_flight,
            "fragments": len(self.diloco.fragments),
            "momentum": "momentum" in saved,
            "equal": self.diloco.replicas_equal,
        }
        return out

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: list[Any],
        strict: bool,
        weights_only: bool | None,
        dims: ParallelDims,
        rank: int,
    ) -> dict[str, Any]:
        """Load the sharded checkpoint ``path`` into the model and optimizers (any layout) and, under DiLoCo, this
        replica's parameters and inner optimizer state and the outer state; returns the rest for Lightning.

        Raises:
            ValueError: The checkpoint's DiLoCo state cannot continue here (another ``dp_replicate`` mid-cycle,
                another number of fragments or their split).
        """
        rest = store.read_rest(path, weights_only)
        meta = rest.pop("diloco", None)
        if self.diloco is None or meta is None:
            store.load_sharded(path, model, optimizers, strict)
            self.reset()  # nothing to continue (a run without DiLoCo, or none here)
            return rest
        replica = dims.coordinates(rank)["dp_replicate"]
        under = replica_key(path, meta, dims.dp_replicate, replica, len(self.diloco.fragments))
        outer = self.diloco.empty_state(list(meta["in_flight"]), meta["momentum"])
        store.load_sharded(path, model, optimizers, strict, under=under, extra={"diloco": outer})
        self.diloco.load_state_dict({"step": meta["step"], "in_flight": meta["in_flight"], **outer})
        return rest

    def reset(self) -> None:
        """A fresh outer cycle from the current (just loaded) parameters."""
        if self.diloco is not None:
            self.diloco.reset()


def replica_key(path: Path, meta: dict[str, Any], replicas: int, replica: int, fragments: int) -> str:
    """Where replica ``replica`` of ``replicas`` (with ``fragments`` fragments) reads its parameters and inner
    optimizer state from the checkpoint ``path`` whose DiLoCo state is ``meta``: its own key ``replica<r>`` (``""``,
    the top level, for replica 0), or replica 0's when ``dp_replicate`` changed where the replicas are equal.

    Raises:
        ValueError: Another ``dp_replicate`` between outer steps, or another number of fragments (one line).
    """
    if meta["replicas"] != replicas and not meta["equal"]:
        raise ValueError(
            f"checkpoint {path} holds DiLoCo replicas of dp_replicate={meta['replicas']} between outer steps (inner "
            f"step {meta['step']}; they differ) and this run has dp_replicate={replicas}; resume with "
            f"dp_replicate={meta['replicas']}, or change it from a checkpoint right after an outer step "
            "(diloco.fragments=1, diloco.alpha=0, nothing in flight)."
        )
    if meta["fragments"] != fragments:
        raise ValueError(
            f"checkpoint {path} holds DiLoCo state of parallelism.diloco.fragments={meta['fragments']} and this run "
            f"has {fragments}; resume with parallelism.diloco.fragments={meta['fragments']}."
        )
    return f"replica{replica}" if replica and meta["replicas"] == replicas else ""


def _mesh_axes(tensor: Tensor) -> tuple[str, ...]:
    mesh = getattr(tensor, "device_mesh", None)
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _fqn(name: str) -> str:
    """``name`` without torch's in-model wrappers (compile, activation checkpointing): the same in every layout."""
    for part in full.WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
