"""Single-file (full) checkpoints, Lightning's ``.ckpt`` written by one process, read into any layout; and the check
that a checkpoint's names and shapes fit a model, for single files and sharded folders alike.

Every rank maps the file (``torch.load(mmap=True)``: pages are read on demand and shared between the ranks) and is
given only the names it holds: a pipeline rank its stages' (a weight tied across stages goes to each rank with a
copy), a whole-model rank all of them. torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``full_state_dict=True`` then cut each full tensor into this rank's DTensor shard (TP, FSDP2, HSDP, replicas).

Lightning saves one process's optimizer as ``optimizer.state_dict()``: its state is keyed by parameter index, index
``k`` of group ``g`` being the ``k``-th parameter of group ``g`` in the unsplit module's ``named_parameters()``
order. :class:`ModelNames` records that order before the model is parallelized, the ranks' optimizers tell which
group each parameter is in, and the state is keyed by name: per name, the state a sharded checkpoint stores
flattened (``state.<name>.<key>``, see :mod:`lightning_dist.checkpoint.store`). It is handed to torch nested by name
(torch 2.13's full-state-dict load fails on the flattened form).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

Shape = tuple[int, ...]
MODEL_KEY = "state_dict"  #: where Lightning keeps the module's tensors (a file's key, a sharded folder's prefix)
#: Name parts of torch's in-model wrappers (torch.compile's module, activation checkpointing's wrapper) that torch's
#: state-dict names leave out, as ours do.
WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


@dataclass(frozen=True)
class ModelNames:
    """The unsplit module's names, recorded before it is parallelized (TP / FSDP2 keep names, pipelines drop some)."""

    shapes: dict[str, Shape]
    """Every tensor of its ``state_dict()`` (a tied weight under each of its names) and its full shape."""
    params: tuple[str, ...]
    """Its ``named_parameters()`` in order, each parameter once (a tied one under its first name): one process's
    order of the optimizer's parameters."""
    aliases: dict[str, str]
    """Each name of a parameter -> the name it has in :attr:`params`."""

    @classmethod
    def of(cls, module: nn.Module) -> ModelNames:
        state = module.state_dict(keep_vars=True)  # references only (a meta-device model has no data anyway)
        shapes = {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}
        first: dict[int, str] = {}
        named = [(_unwrapped(name), id(p)) for name, p in module.named_parameters(remove_duplicate=False)]
        aliases = {name: first.setdefault(key, name) for name, key in named}
        return cls(shapes, tuple(dict.fromkeys(aliases.values())), aliases)


# ------------------------------------------------------------------------------------------------- names, shapes
def read(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's single-file checkpoint ``path``, memory-mapped (tensors are read when used)."""
    return torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)


def checkpoint_shapes(path: Path, weights_only: bool | None = None) -> dict[str, Shape]:
    """The module's tensors in the checkpoint ``path`` (a single file or a sharded folder) and their shapes."""
    path = Path(path)
    if path.is_dir():
        try:
            stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as err:  # a truncated or foreign .metadata: pickle / DCP raise many kinds
            raise ValueError(
                f"checkpoint {path} cannot be read ({type(err).__name__} in its .metadata); it is damaged or not a "
                "lightning-dist checkpoint: continue from an older checkpoints/step-N, or start without it."
            ) from None
        prefix = f"{MODEL_KEY}."
        return {
            key[len(prefix) :]: tuple(meta.size)
            for key, meta in stored.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
    return shapes_of(read(path, weights_only), path)


def shapes_of(checkpoint: Mapping[str, Any], path: Path) -> dict[str, Shape]:
    """The shapes of a loaded single-file checkpoint's module tensors.

    Raises:
        ValueError: ``checkpoint`` is not a Lightning checkpoint (it has no ``state_dict``).
    """
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get(MODEL_KEY), Mapping):
        raise ValueError(
            f"checkpoint {path} is not a Lightning checkpoint (no '{MODEL_KEY}'); give a file Trainer.save_checkpoint "
            "wrote (or a checkpoints/step-N of a run), or load bare weights in your module's configure_model."
        )
    return {name: tuple(t.shape) for name, t in checkpoint[MODEL_KEY].items() if isinstance(t, torch.Tensor)}


def check_fits(
    label: str, stored: Mapping[str, Shape], model: Mapping[str, Shape], fix: str, strict: bool = True, loose: str = ""
) -> None:
    """Raise one line naming the first tensor of ``model`` (name -> shape) that ``stored`` holds with another shape
    or (``strict``) lacks, or the first tensor ``stored`` holds that the model lacks (``strict``; ``loose`` is added
    to ``fix`` then: how to load such a checkpoint anyway).

    Raises:
        ValueError: ``"<label>: <name> has shape (..) there and (..) in the model; <fix>"`` or the like.
    """
    for name, shape in model.items():
        if name not in stored:
            if strict:
                raise ValueError(f"{label} has no tensor {name} (shape {shape} in the model); {fix}{loose}")
        elif tuple(stored[name]) != tuple(shape):
            raise ValueError(
                f"{label}: {name} has shape {tuple(stored[name])} there and {tuple(shape)} in the model; {fix}"
            )
    extra = [name for name in stored if name not in model]
    if strict and extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(
            f"{label} holds {extra[0]} (shape {tuple(stored[extra[0]])}){more}, which the model lacks; {fix}{loose}"
        )


def check_module_fits(path: Path, stored: Mapping[str, Shape], names: ModelNames, strict: bool) -> None:
    """:func:`check_fits` at load time, for any module (a library user's too).

    Raises:
        ValueError: One line naming the tensor, its shape in the checkpoint and in the module.
    """
    fix = "build the module with the configuration the checkpoint was written with"
    loose = " (or set strict_loading=False on the module to skip missing and unexpected tensors)"
    check_fits(f"checkpoint {path}", stored, names.shapes, fix, strict, loose)


# -------------------------------------------------------------------------------------------------------- load
def load_model(model: nn.Module, full_state: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Fill this rank's part of ``model`` in place from the one-process state ``full_state`` (name -> full tensor).

    Only the names this rank holds are given to torch (its stages' under a pipeline); each full tensor is cut into
    this rank's shard of a DTensor parameter (one scatter over its mesh) or copied whole into a plain one.
    """
    held = get_model_state_dict(model)  # this rank's names (no copies: its own tensors)
    mine = {name: full_state[name] for name in held if name in full_state}
    set_model_state_dict(model, mine, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_optimizers(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    saved: list[Mapping[str, Any]],
    names: ModelNames,
    strict: bool,
) -> None:
    """Fill ``optimizers`` in place from one process's ``saved`` states (Lightning's ``optimizer_states``).

    Collective: the ranks' optimizers together tell which group each of the unsplit module's parameters is in.

    Raises:
        ValueError: The groups in the file do not match the optimizers' (one line).
    """
    if len(saved) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(saved)} optimizer states and configure_optimizers() returns "
            f"{len(optimizers)} optimizers; resume with the optimizers the checkpoint was written with."
        )
    name_of = {param: _unwrapped(name) for name, param in model.named_parameters()}  # as torch names them
    mine = [
        [[names.aliases.get(name_of[p], name_of[p]) for p in g["params"]] for g in opt.param_groups]
        for opt in optimizers
    ]
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    for idx, (optimizer, state) in enumerate(zip(optimizers, saved)):
        index_of = _indices(idx, state, [rank[idx] for rank in everyone], names.params)
        by_name: dict[str, Any] = {"state": {}, "param_groups": []}
        for g, group in enumerate(optimizer.param_groups):
            fqns = [name_of[p] for p in group["params"]]
            settings = {key: value for key, value in state["param_groups"][g].items() if key != "params"}
            by_name["param_groups"].append({**settings, "params": fqns})
            for fqn in fqns:
                index = index_of[g][names.aliases.get(fqn, fqn)]
                if index in state["state"]:
                    by_name["state"][fqn] = state["state"][index]
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_optimizer_state_dict(model, optimizer, by_name, options=options)


def _indices(
    idx: int, state: Mapping[str, Any], groups_of_ranks: list[list[list[str]]], order: tuple[str, ...]
) -> list[dict[str, int]]:
    """For each parameter group: name -> its index in one process's optimizer state."""
    saved_groups = state["param_groups"]
    counts = {len(groups) for groups in groups_of_ranks}
    if counts != {len(saved_groups)}:
        raise ValueError(
            f"optimizer {idx} has {len(saved_groups)} parameter groups in the checkpoint and {max(counts)} from "
            "configure_optimizers(); resume with the optimizer groups the checkpoint was written with."
        )
    found: list[dict[str, int]] = []
    for g, saved_group in enumerate(saved_groups):
        members = {name for groups in groups_of_ranks for name in groups[g]}
        names = [name for name in order if name in members]
        if len(names) != len(saved_group["params"]):
            raise ValueError(
                f"optimizer {idx}, parameter group {g}: the checkpoint holds {len(saved_group['params'])} parameters "
                f"there and configure_optimizers() puts {len(names)} there; resume with the model and optimizer "
                "groups the checkpoint was written with."
            )
        found.append(dict(zip(names, saved_group["params"])))
    return found


def _unwrapped(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
