"""HuggingFace weights written during training (``checkpoint.save_hf=true``), beside each checkpoint, under any layout.

Every rank writes the slices it holds through DCP's ``HuggingFaceStorageWriter`` (safetensors, under the HuggingFace
model's names), which rank 0 then consolidates into whole-tensor files (``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``); ``config.json``, the tokenizer and ``generation_config.json`` of the folder the run
started from go beside them. So ``<checkpoint>/hf`` is what ``lightning-dist-export`` would write, without a second
pass: ``AutoModelForCausalLM.from_pretrained``, ``lightning-dist-eval`` and ``lightning-dist-generate`` read it.

A LoRA run (``model.lora``) writes its adapters as a peft adapter folder instead (``adapter_model.safetensors``,
``adapter_config.json``: a few MB, read with the base model), the same as the export's default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_dist.checkpoint.adapters import hf_layer_names, lora_of
from lightning_dist.checkpoint.export import copy_tokenizer_files
from lightning_dist.checkpoint.folder import HF_FOLDER
from lightning_dist.checkpoint.weights import MODULE_ATTR
from lightning_dist.manifest import make_readable
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.gpt_hf import hf_config, hf_tensors, same
from lightning_dist.models.lora import adapted_layers, adapter_names, peft_adapter_name

MAX_SHARD_BYTES = 5 * 2**30  #: as transformers' save_pretrained and lightning-dist-export


def save_hf(module: nn.Module, folder: Path, hyper_parameters: dict[str, Any]) -> Path:
    """Write ``module``'s weights (or its LoRA adapters) as a HuggingFace folder at ``folder``; every rank calls it
    (the write is collective), rank 0 consolidates and writes the config and tokenizer."""
    folder = Path(folder)
    state = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=False))
    lora = lora_of(hyper_parameters)
    if lora is not None:
        names = _adapter_names(state, hyper_parameters)
    else:
        names = _model_names(state, hyper_parameters)
    hf_state = {names[name]: tensor for name, tensor in state.items() if name in names}
    sizes = {name: t.numel() * t.element_size() for name, t in hf_state.items()}  # a DTensor's: global
    if dist.is_initialized():  # under a pipeline each rank holds other tensors: the files are planned from all
        every: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, sizes)
        sizes = {name: size for part in every for name, size in sorted(part.items())}
    shards = _shard_index(sizes)
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = dcp.HuggingFaceStorageWriter(
        str(folder), fqn_to_index_mapping=shards, save_distributed=True, enable_consolidation=True
    )
    dcp.save(hf_state, storage_writer=writer, no_dist=not dist.is_initialized())
    if rank == 0:
        shutil.rmtree(folder / "sharded", ignore_errors=True)  # the ranks' slices, now consolidated
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)  # DCP's; ours names the files we keep
        files = sorted(folder.glob("*.safetensors"))
        if lora is not None:
            files[0].rename(folder / "adapter_model.safetensors")
            (folder / "adapter_config.json").write_text(json.dumps(_adapter_config(lora, names, hyper_parameters)))
        else:
            _write_config(folder, files, sizes, hyper_parameters)
        source = hyper_parameters.get("hf_source")
        if source:
            copy_tokenizer_files(Path(source), folder)
        make_readable(folder)  # safetensors writes 0600: a serving job of another user reads this folder
    return folder


def _model_names(state: dict[str, Any], hp: dict[str, Any]) -> dict[str, str]:
    """Each tensor's HuggingFace name (a tied head left out: transformers ties it again)."""
    if "hf_config" in hp:
        tied = hp["hf_config"].get("tie_word_embeddings", False)
        return {n: n[len(MODULE_ATTR) :] for n in state if not (tied and n.endswith("lm_head.weight"))}
    gpt = GPTConfig(**hp["model"])
    renamed = {MODULE_ATTR + c.sources[0]: c.name for c in hf_tensors(gpt) if c.combine is same}
    return {n: renamed[n] for n in state if n in renamed}


def _adapter_names(state: dict[str, Any], hp: dict[str, Any]) -> dict[str, str]:
    """Each adapter's name in a peft adapter file; the frozen weights are not written."""
    layers = adapted_layers(state)
    hf_layers = hf_layer_names(hp, layers)
    names = {}
    for layer in layers:
        for which, name in zip("AB", adapter_names(layer)):
            names[name] = peft_adapter_name(hf_layers[layer], which)
    return names


def _adapter_config(lora: Any, names: dict[str, str], hp: dict[str, Any]) -> dict[str, Any]:
    import peft  # optional dependency: lightning-dist[hf]

    layers = sorted({name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for name in names.values()})
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=layers,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=hp.get("hf_source"),
        fan_in_fan_out=(hp.get("hf_config") or {}).get("model_type") == "gpt2",
    )
    return config.to_dict() | {"target_modules": layers, "peft_type": "LORA", "task_type": "CAUSAL_LM"}


def _shard_index(sizes: dict[str, int]) -> dict[str, int]:
    """Each tensor's output file (1, 2, ...): in order, a new file once one would pass :data:`MAX_SHARD_BYTES`."""
    index, size, shards = 1, 0, {}
    for name, nbytes in sizes.items():
        if size and size + nbytes > MAX_SHARD_BYTES:
            index, size = index + 1, 0
        shards[name], size = index, size + nbytes
    return shards


def _write_config(folder: Path, files: list[Path], sizes: dict[str, int], hp: dict[str, Any]) -> None:
    """``config.json``; the weights as ``model.safetensors``, or with the index transformers reads for several."""
    config = dict(hp["hf_config"]) if "hf_config" in hp else hf_config(GPTConfig(**hp["model"]))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(files) == 1:
        files[0].rename(folder / "model.safetensors")
        return
    by_index = {int(file.name.split("-")[1]): file.name for file in files}  # model-00001-of-00003.safetensors
    weight_map = {name: by_index[index] for name, index in _shard_index(sizes).items()}
    total = sum(sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


__all__ = ["HF_FOLDER", "save_hf"]
