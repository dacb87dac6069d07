"""DiLoCo in the strategy: the outer step after each applied inner step, and each replica's state in checkpoints.

``sync="diloco"`` (:class:`~lightning_dist.parallel.options.ParallelOptions`) lays the model out without gradient
synchronization over ``dp_replicate`` (:func:`~lightning_dist.parallel.compose.data_parallel_axes`) and runs
:class:`~lightning_dist.parallel.diloco.DiLoCo` here. Replicas hold different parameters and inner optimizer states
between outer steps, and DCP keeps one copy of what looks replicated, so each rank also writes its own file into the
sharded checkpoint folder (:func:`lightning_dist.checkpoint.store.save_rank_state`): its DiLoCo state (backup, outer
momentum, position in the cycle, exchanges in flight, its parameter shards) and its inner optimizer state. A resume
restores them after DCP's load; it needs the layout and world size that saved them (no resharding: one line says
so). The model weights DCP holds are one replica's; a single-file checkpoint has no DiLoCo state, so loading one (or a
sharded checkpoint of a run without DiLoCo) starts a fresh outer cycle from its weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dist.checkpoint import store
from lightning_dist.contract import declared_blocks
from lightning_dist.parallel.diloco import DiLoCo, describe
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.parallel_dims import ParallelDims

#: Mesh axis names that include dp_replicate (the flattened data-parallel axes too).
_REPLICA_AXES = {"dp_replicate", "dp", "data_parallel"}


class DiLoCoMixin:
    """For :class:`~lightning_dist.strategies.mesh.MeshStrategy`: builds and runs DiLoCo when ``options.diloco``."""

    options: ParallelOptions
    parallel_dims: ParallelDims
    model: nn.Module
    lightning_module: Any
    optimizers: list[torch.optim.Optimizer]
    global_rank: int
    broadcast: Callable[..., Any]
    _diloco: DiLoCo | None = None

    @property
    def diloco(self) -> DiLoCo | None:
        """This rank's :class:`~lightning_dist.parallel.diloco.DiLoCo` (``sync="diloco"``, once fitting set up)."""
        return self._diloco

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizers, then DiLoCo over the parameters as laid out (``sync=diloco``)."""
        super().setup_optimizers(trainer)  # type: ignore[misc]
        self.build_diloco()

    def with_sync(self, layout: RankLayout) -> RankLayout:
        """``layout`` saying how the replicas agree (DiLoCo's H, F, compression; nothing for every step)."""
        return replace(layout, sync=describe(self.options))

    def build_diloco(self) -> None:
        """Start DiLoCo from the current parameters (after the optimizers exist); nothing without ``sync=diloco``.

        Raises:
            ValueError: Not exactly one optimizer (one inner step per outer count), or a parameter laid out by hand
                over ``dp_replicate`` (its gradients would be averaged every step).
        """
        if not self.options.diloco:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"sync=diloco counts one inner optimizer step per training step but configure_optimizers returned "
                f"{len(self.optimizers)} optimizers; use one optimizer or sync=every_step."
            )
        params = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        synced = [name for name, p in params if _REPLICA_AXES & set(_mesh_axes(p))]
        if synced:  # laid out by hand in configure_model over a mesh that averages the replicas every step
            raise ValueError(
                f"sync=diloco but {synced[0]} is sharded or replicated over the dp_replicate axis, so its gradients "
                "are averaged every step; shard it over device_mesh['dp_shard'] only, or use sync=every_step."
            )
        blocks: list[str] = []
        if not self.parallel_dims.pp_enabled:  # a pipeline rank holds some blocks only: split by size there
            names = {id(module): name for name, module in self.model.named_modules()}
            blocks = [names[id(b)] for b in declared_blocks(self.lightning_module) if id(b) in names]
        self._diloco = DiLoCo.build(params, self.parallel_dims.group("dp_replicate"), self.options, blocks)

    def with_outer_step(self, apply: Callable[[], Any]) -> Callable[[], Any]:
        """``apply`` (an inner optimizer step) followed by DiLoCo's count; a step the guard drops is not counted.

        A step an optimizer skips on the device (fused kernels, ``found_inf``) still counts: knowing it would cost a
        host read every step.
        """
        diloco = self._diloco
        if diloco is None:
            return apply

        def step() -> Any:
            result = apply()
            diloco.after_inner_step()
            return result

        return step

    def save_replica_state(self, filepath: Any) -> None:
        """Write this rank's DiLoCo and inner optimizer state into the checkpoint folder (nothing without DiLoCo)."""
        if self._diloco is None:
            return
        path = Path(self.broadcast(filepath))
        state = {
            "layout": self.parallel_dims.describe(),
            "diloco": self._diloco.state_dict(),
            "optimizers": [_local_optimizer_state(optimizer) for optimizer in self.optimizers],
        }
        store.save_rank_state(path, self.global_rank, state)

    def load_replica_state(self, path: Path) -> None:
        """After DCP's load: this rank's own DiLoCo and inner optimizer state, or a fresh cycle when there is none.

        Raises:
            ValueError: The state was saved under another layout (one line; DiLoCo state does not reshard).
        """
        if self._diloco is None:
            return
        state = store.load_rank_state(path, self.global_rank)
        if state is None:
            self._diloco.reset()
            return
        layout = self.parallel_dims.describe()
        if state["layout"] != layout:
            raise ValueError(
                f"checkpoint {path} holds DiLoCo state of the layout {state['layout']}, not {layout}; DiLoCo state "
                "does not reshard: resume with that layout."
            )
        self._diloco.load_state_dict(state["diloco"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            _load_local_optimizer_state(optimizer, saved)

    def reset_diloco(self) -> None:
        """A fresh outer cycle from the current (just loaded) parameters."""
        if self._diloco is not None:
            self._diloco.reset()


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's per-parameter state as this rank's local shards, keyed by parameter position."""
    out: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        state = optimizer.state.get(param)
        if state:
            out[index] = {k: _local(v).detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
                          for k, v in state.items()}  # fmt: skip
    return out


def _load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[int, dict[str, Any]]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        for index, values in saved.items():
            state = optimizer.state[params[index]]
            for key, value in values.items():
                if isinstance(value, Tensor) and isinstance(state.get(key), Tensor):
                    _local(state[key]).copy_(value)
                else:
                    state[key] = value


def _mesh_axes(tensor: Tensor) -> tuple[str, ...]:
    mesh = getattr(tensor, "device_mesh", None)
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
