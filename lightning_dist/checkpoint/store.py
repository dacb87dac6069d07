"""Sharded checkpoints (``torch.distributed.checkpoint``) for every layout, pipelines included.

Parameter names are always the full model's (pipeline splitting keeps them), and the optimizer state is stored
flattened, one key per parameter (``state.layers.0.w.exp_avg``, ``param_groups.layers.0.w.lr``). Lightning's nested
form has one ``param_groups`` entry per optimizer, which DCP keeps from a single rank; pipeline ranks hold different
parameters, so the others would lose their groups on load (torchtitan flattens too). So every rank saves and loads
exactly its own keys. DCP keeps one copy of a tensor several ranks hold alike (same key, same shard); ranks whose
values differ (DiLoCo's replicas between outer steps) save theirs under a key of their own (:func:`load_sharded`'s
``under``), resharded as any other.
"""

from __future__ import annotations

import shutil
import zipfile
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
    path: Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    under: str = "",
    extra: dict[str, Any] | None = None,
) -> None:
    """Load the sharded checkpoint folder ``path`` into ``model`` and ``optimizers`` in place, under any layout.

    Every rank asks DCP for exactly the keys its model and optimizers hold (plain tensors of a pipeline stage and
    DTensors of TP / FSDP2 alike), so a rank's stages and shards are filled from whatever layout wrote the files.
    ``under``: the key they were saved under (:func:`save`; ``""``: the top level, as every run saves them);
    ``extra``: more tensors to fill in place from the same read (laid out as they were given to :func:`save`).
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_LOAD)
    dcp.load({under: state, **(extra or {})} if under else {**state, **(extra or {})}, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_STATE_LOAD)


def read_rest(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """The rest of Lightning's checkpoint in the folder ``path`` (loops, callbacks, LR schedulers, ...)."""
    return torch.load(path / _compat.checkpoint_metadata_file(), weights_only=weights_only)


def sharded_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What of Lightning's ``checkpoint`` DCP writes (taken out of it): ``state_dict`` and each ``optimizer_<i>``."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def save(state: dict[str, Any], rest: dict[str, Any], path: Path, global_rank: int, group: Any = None) -> Any:
    """Write ``state`` (:func:`sharded_state`, and any keys of this rank's own) through DCP to the folder ``path``
    and Lightning's ``rest`` into one file from rank 0: Lightning's sharded layout. Returns ``None``, or with a
    ``group`` the background write's future.

    With ``group``, a gloo group of its own (its collectives never run beside the training's on one group), DCP copies
    the state to host memory before this returns, so training may change the weights at once; the folder is complete
    when rank 0's future is done (DCP writes ``.metadata`` after every rank's data).
    """
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    future = None
    if group is None:
        dcp.save(state, checkpoint_id=path)
    else:
        future = dcp.async_save(state, checkpoint_id=path, process_group=group)
    if global_rank == 0:
        torch.save(rest, path / _compat.checkpoint_metadata_file())
    return future


# ------------------------------------------------------------------------------------------ during the run
LATEST = "latest"  #: the file naming the newest complete checkpoint of a run's checkpoint folder


def complete_checkpoints(dirpath: Path) -> list[Path]:
    """The published checkpoints in ``dirpath``, oldest first (``.partial`` ones are unfinished saves)."""
    if not Path(dirpath).is_dir():
        return []
    return sorted(p for p in Path(dirpath).iterdir() if p.name.startswith("step-"))


def latest_checkpoint(dirpath: Path) -> Path | None:
    """The checkpoint the ``latest`` file names, else the newest published one that is whole; ``None`` if none."""
    pointer = Path(dirpath) / LATEST
    if pointer.is_file():
        named = Path(dirpath) / pointer.read_text().strip()
        if named.exists() and damage(named) is None:
            return named
    whole = [path for path in complete_checkpoints(dirpath) if damage(path) is None]
    return whole[-1] if whole else None


def damage(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be loaded (missing parts, a truncated file), or ``None`` if it looks whole.

    A sharded folder is whole once DCP wrote ``.metadata`` (its last step) and Lightning its own file; a single file
    is a zip archive (``torch.save``) whose directory, at its end, is readable.
    """
    path = Path(path)
    if path.is_dir():
        missing = [name for name in (".metadata", _compat.checkpoint_metadata_file()) if not (path / name).is_file()]
        return f"missing {', '.join(missing)}" if missing else None
    if not path.is_file():
        return "no such file or folder"
    return None if zipfile.is_zipfile(path) else "not a complete torch.save archive (truncated?)"


def check_loadable(path: Path) -> None:
    """Raise one line naming ``path``, what is wrong with it and the newest whole checkpoint beside it.

    Raises:
        ValueError: The checkpoint is damaged.
    """
    problem = damage(path)
    if problem is None:
        return
    good = latest_checkpoint(Path(path).parent)
    fallback = f"the newest whole checkpoint there is {good}" if good else "there is no whole checkpoint beside it"
    raise ValueError(f"checkpoint {path} cannot be loaded ({problem}); {fallback}.")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
