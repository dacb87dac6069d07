"""HuggingFace weights saved under other names or shapes than the model's: transformers 5 saves an MoE's experts
one by one (``experts.3.gate_proj.weight``) and stacks them when it loads (``experts.gate_up_proj``), renames legacy
keys, fuses projections. These tensors are read through transformers' own conversion rules (the renamings and
converters ``from_pretrained`` applies), then each rank keeps its slice (:func:`load_converted`).

A converted tensor is built whole on each rank that holds part of it, one tensor at a time (an MoE layer's stacked
experts at most), from the safetensors files directly: no collective, so each pipeline stage reads only its layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dist import _compat
from lightning_dist.models.hf import HFCausalLM

MODULE_ATTR = "model."  # HFCausalLM.model holds the transformers model


@dataclass
class Conversion:
    """How one of the model's tensors is made from saved ones.

    Attributes:
        target: The tensor's name in the transformers model (``model.layers.1.mlp.experts.gate_up_proj``).
        sources: The saved tensors, by the converter's source pattern they matched, in transformers' order.
        converter: transformers' ``WeightConverter`` (``None``: a renaming, one saved tensor as it is).
    """

    target: str
    sources: dict[str, list[str]] = field(default_factory=dict)
    converter: Any = None


def conversions(module: Any, state: dict[str, Any], available: Any) -> dict[str, Conversion]:
    """For each tensor of ``state`` (``module``'s, this rank's) that the folder holds under another name or shape
    (its keys: ``available``), how transformers makes it; ``{}`` for anything but ``model=hf``."""
    if not isinstance(module, HFCausalLM):
        return {}
    wanted = {name[len(MODULE_ATTR) :]: name for name in state if name[len(MODULE_ATTR) :] not in available}
    if not wanted:
        return {}
    model = module.model
    renamings, converters = _compat.hf_weight_transforms(model)
    if not renamings and not converters:
        return {}
    names = dict.fromkeys(name[len(MODULE_ATTR) :] for name in state)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    found: dict[str, Conversion] = {}
    prefix = getattr(model, "base_model_prefix", "")
    for key in sorted(available, key=_compat.hf_natural_key):
        target, pattern = _compat.hf_rename_source_key(key, renamings, converters, prefix, names)
        if target not in wanted:
            continue
        conversion = found.setdefault(target, Conversion(target, converter=by_pattern.get(pattern)))
        conversion.sources.setdefault(pattern or key, []).append(key)
    return {wanted[target]: conversion for target, conversion in found.items()}


def load_converted(path: Path, found: dict[str, Conversion], state: dict[str, Any], model: Any) -> None:
    """Make each tensor of ``found`` from the saved ones in ``path`` and copy this rank's slice into ``state``.

    Raises:
        ValueError: The made tensor's shape is not the model's (one line).
    """
    files = _files(Path(path))
    for name, conversion in found.items():
        whole = _convert(conversion, files, model)
        into = state[name]
        if tuple(whole.shape) != tuple(into.shape):
            raise ValueError(
                f"init_from={path}: {conversion.target} made from {next(iter(conversion.sources.values()))[0]}... "
                f"has shape {tuple(whole.shape)} and {tuple(into.shape)} here; set the model config the weights were "
                "trained with."
            )
        if isinstance(into, DTensor):  # each rank slices its own part of the whole: no communication
            local = distribute_tensor(whole.to(into.dtype), into.device_mesh, into.placements, src_data_rank=None)
            into.to_local().copy_(local.to_local())
        else:
            into.copy_(whole)


def _convert(conversion: Conversion, files: dict[str, Path], model: Any) -> torch.Tensor:
    from safetensors import safe_open

    tensors: dict[str, list[torch.Tensor]] = {}
    for pattern, keys in conversion.sources.items():
        for key in keys:
            with safe_open(str(files[key]), framework="pt") as file:
                tensors.setdefault(pattern, []).append(file.get_tensor(key))
    converter = conversion.converter
    if converter is None:
        return next(iter(tensors.values()))[0]
    made: dict[str, Any] = tensors
    for operation in converter.operations:
        made = operation.convert(
            made,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=conversion.target,
            model=model,
            config=getattr(model, "config", None),
        )
    if len(made) == 1:
        return next(iter(made.values()))
    return next(tensor for pattern, tensor in made.items() if pattern in conversion.target)


def _files(path: Path) -> dict[str, Path]:
    """Which safetensors file of ``path`` holds each tensor (its index, or the one file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {key: path / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            files.update(dict.fromkeys(opened.keys(), file))
    return files
