"""Weights read into any layout: each rank reads only the slices its shards and stages hold, from a sharded
checkpoint folder or a HuggingFace folder (safetensors, through their names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dist.checkpoint.hf_conversion import Conversion, conversions, load_converted
from lightning_dist.checkpoint.store import read_rest
from lightning_dist.models.gpt_hf import from_hf_names
from lightning_dist.models.hf import HFCausalLM
from lightning_dist.models.lora import base_name, is_adapter
from lightning_dist.models.module import GPTModule
from lightning_dist.models.qlora import NF4_NAMES, dequantized, nf4_target

MODULE_ATTR = "model."  # GPTModule.model and HFCausalLM.model hold the network


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a HuggingFace model folder (``config.json`` and safetensors)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hf_source_names(module: Any, state: dict[str, Any], available: Any) -> dict[str, str]:
    """For each of ``module``'s tensors in ``state`` (this rank's), the HuggingFace tensor it is read from.

    A tied output head reads ``lm_head.weight`` where the folder has it, else the input embedding (transformers
    leaves a tied head out of its files). A layer LoRA adapted reads its weight under the model's own name
    (``q_proj.base_layer.weight`` from ``q_proj.weight``); the adapters are not in ``state`` (they keep their values).

    Raises:
        ValueError: ``module`` is neither the built-in GPT nor an :class:`HFCausalLM`.
    """
    if isinstance(module, GPTModule):
        names = from_hf_names(module.model_config)
        sources = {name: names[base_name(name)[len(MODULE_ATTR) :]] for name in state}
    elif isinstance(module, HFCausalLM):
        sources = {name: base_name(name)[len(MODULE_ATTR) :] for name in state}
        for names in _tied_names(module).values():  # a tied head (whatever its name) reads the weight that is saved
            saved = [name for name in names if name[len(MODULE_ATTR) :] in available]
            for name in names:
                if name in sources and sources[name] not in available and saved:
                    sources[name] = saved[0][len(MODULE_ATTR) :]
        return sources
    else:
        raise ValueError(
            f"init_from a HuggingFace folder needs the built-in GPT or model=hf, not {type(module).__name__}; start "
            "from a lightning-dist checkpoint folder, or load the weights in your module's configure_model."
        )
    for name, source in sources.items():
        if source == "lm_head.weight" and source not in available:
            embedding = [key for key in ("model.embed_tokens.weight", "transformer.wte.weight") if key in available]
            sources[name] = embedding[0] if embedding else source
    return sources


def _tied_names(module: nn.Module) -> dict[int, list[str]]:
    """The names of each parameter ``module`` holds under several names (a head tied to the embedding)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {key: group for key, group in names.items() if len(group) > 1}


def weight_sources(path: Path, module: nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """For each tensor of ``state`` (``module``'s, this rank's), the key it is read from in ``path``.

    Raises:
        ValueError: ``path`` lacks a tensor the module needs, or holds it with another shape (one line).
    """
    available = reader(path).read_metadata().state_dict_metadata
    state = adapters_left_out(state, available, is_hf_folder(path))
    if is_hf_folder(path):
        sources = hf_source_names(module, state, available)
    else:  # a checkpoint without adapters (a full fine-tune) is the base of a LoRA run under its own names
        sources = {name: f"state_dict.{name}" for name in state}
        sources = {n: s if s in available else f"state_dict.{base_name(n)}" for n, s in sources.items()}
    for name, source in sources.items():
        shape = tuple(state[name].shape)
        if source not in available:
            raise ValueError(f"init_from={path} has no tensor {source} (for {name}); is it this model's checkpoint?")
        if tuple(available[source].size) != shape:
            raise ValueError(
                f"init_from={path}: {source} has shape {tuple(available[source].size)} there and {shape} here; set "
                "the model config the weights were trained with."
            )
    return sources


def weight_plan(path: Path, module: nn.Module, state: dict[str, Any]) -> tuple[dict[str, str], dict[str, Conversion]]:
    """:func:`weight_sources` for the tensors of ``state`` saved as they are, and how transformers makes the others
    from what it saved (an MoE's experts one by one: :mod:`~lightning_dist.checkpoint.hf_conversion`).

    Raises:
        ValueError: See :func:`weight_sources`.
    """
    available = reader(path).read_metadata().state_dict_metadata
    converted = conversions(module, state, available) if is_hf_folder(path) else {}
    return weight_sources(path, module, {n: t for n, t in state.items() if n not in converted}), converted


def adapters_left_out(state: dict[str, Any], available: Any, hf: bool) -> dict[str, Any]:
    """``state`` without the LoRA adapters that the weights do not hold (a HuggingFace folder never does; a
    checkpoint of a LoRA run does): those keep the values they were initialized with."""
    return {n: t for n, t in state.items() if not (is_adapter(n) and (hf or f"state_dict.{n}" not in available))}


def load_weights(path: Path, module: nn.Module) -> None:
    """Fill ``module``'s weights in place from a HuggingFace folder or a checkpoint folder, under any layout.

    Every rank reads only the slices its shards and stages hold (DCP's resharding; ``HuggingFaceStorageReader`` for
    safetensors). The optimizer, schedule and data position are not read: a new run starts from these weights.

    Raises:
        ValueError: See :func:`weight_plan`.
    """
    state = get_model_state_dict(module)
    sources, converted = weight_plan(path, module, state)  # adapters a folder lacks are left out: they keep values
    # A QLoRA checkpoint's NF4 tensors are read whole into NF4 targets, then given to the module dequantized (a QLoRA
    # run quantizes them again once they are in place).
    nf4 = set() if is_hf_folder(path) else {f"state_dict.{name}" for name in read_rest(path, False).get(NF4_NAMES, [])}
    whole = {}
    if nf4:
        saved = reader(path).read_metadata().state_dict_metadata
        whole = {n: nf4_target(saved[s].size, saved[s].properties.dtype) for n, s in sources.items() if s in nf4}
    # One DCP read per pass, each source key at most once per pass (a tied head and embedding share one source).
    passes: list[dict[str, Any]] = [{}, {}]
    for name, source in sources.items():
        passes[0 if source not in passes[0] else 1][source] = whole.get(name, state[name])
    for targets in passes:  # every rank runs both passes: DCP's planning is collective
        dcp.load(targets, storage_reader=reader(path))  # a reader is stateful: a new one per load
    for name, target in whole.items():
        _copy_whole(state[name], dequantized(target))
    load_converted(path, converted, state, getattr(module, "model", None))
    set_model_state_dict(module, state)


def _copy_whole(param: Any, value: Any) -> None:
    """Copy the whole tensor ``value`` into ``param``, or into this rank's shard of it (a DTensor)."""
    if isinstance(param, DTensor):  # every rank holds the whole value: each slices its shard, no communication
        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def reader(path: Path) -> Any:
    return dcp.HuggingFaceStorageReader(str(path)) if is_hf_folder(path) else dcp.FileSystemReader(str(path))
