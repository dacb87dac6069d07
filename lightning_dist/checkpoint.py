"""Sharded checkpoints (``torch.distributed.checkpoint``) for every layout, pipelines included.

Parameter names are always the full model's (pipeline splitting keeps them), and the optimizer state is stored
flattened, one key per parameter (``state.layers.0.w.exp_avg``, ``param_groups.layers.0.w.lr``). Lightning's nested
form has one ``param_groups`` entry per optimizer, which DCP keeps from a single rank; pipeline ranks hold different
parameters, so the others would lose their groups on load (torchtitan flattens too). So every rank saves and loads
exactly its own keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_dist import _compat

_OPTIM_STATE_SAVE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
_OPTIM_STATE_LOAD = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened, CPU-offloaded state of ``optimizer`` over ``model``'s parameters, as DCP saves it."""
    return get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_SAVE)


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load the sharded checkpoint folder ``path`` into ``model`` and ``optimizers`` in place, under any layout.

    Every rank asks DCP for exactly the keys its model and optimizers hold (plain tensors of a pipeline stage and
    DTensors of TP / FSDP2 alike), so a rank's stages and shards are filled from whatever layout wrote the files.

    Returns:
        The rest of Lightning's checkpoint (loops, callbacks, LR schedulers, ...), for Lightning to restore.
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_LOAD)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_STATE_LOAD)
    return torch.load(path / _compat.checkpoint_metadata_file(), weights_only=weights_only)
