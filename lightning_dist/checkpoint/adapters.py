"""The LoRA adapters of a checkpoint: written as a peft adapter folder, or merged into the weights they adapt.

A LoRA run's checkpoint holds each adapted layer's frozen weight under peft's name (``q_proj.base_layer.weight``)
and its adapters (``q_proj.lora_A.default.weight``, ``...lora_B...``), with ``model.lora`` in its hyperparameters.

- :func:`export_adapter` writes what ``PeftModel.from_pretrained(base, folder)`` reads: ``adapter_config.json``
  (peft's ``LoraConfig``: rank, alpha, the adapted layers by the HuggingFace model's names, the base model it was
  trained on) and ``adapter_model.safetensors`` (``base_model.model.<layer>.lora_A.weight``), with the tokenizer of
  the folder the run started from. A few MB for an 8B model: what is shared on the hub.
- :class:`MergedCheckpoint` is the checkpoint seen with every adapter folded into its weight (``W + alpha / r * B A``,
  peft's ``merge_and_unload``) under the model's own names, so the HuggingFace and single-file exports write a plain
  model (``lightning-dist-export --merge``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_dist.checkpoint.weights import MODULE_ATTR
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.gpt_hf import hf_tensors, same
from lightning_dist.models.lora import adapted_layers, adapter_names, base_name, is_adapter, merged, peft_adapter_name
from lightning_dist.models.lora_config import LoraConfig


def lora_of(hyper_parameters: dict[str, Any]) -> LoraConfig | None:
    """The ``model.lora`` a checkpoint was trained with (``None`` without adapters)."""
    found = hyper_parameters.get("lora")
    model = hyper_parameters.get("model")
    if found is None and isinstance(model, dict):
        found = model.get("lora")
    lora = LoraConfig(**found) if isinstance(found, dict) else found
    return lora if lora is not None and lora.enabled else None


class MergedCheckpoint:
    """``ckpt`` (a :class:`~lightning_dist.checkpoint.export.Checkpoint` of a LoRA run) with each adapter merged into
    the weight it adapts, under the model's own names; read a few tensors at a time, like the checkpoint itself."""

    def __init__(self, ckpt: Any, lora: LoraConfig) -> None:
        self.ckpt, self.lora = ckpt, lora
        self.path, self.unchecked = ckpt.path, ckpt.unchecked
        self.hyper_parameters = ckpt.hyper_parameters
        self._adapted = set(adapted_layers(ckpt.names))
        self._conv1d = _is_conv1d(ckpt.hyper_parameters)
        self.shapes = {base_name(n): shape for n, shape in ckpt.shapes.items() if not is_adapter(n)}

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        shape, stored = self.shapes[name]
        return shape.numel() * (dtype or stored).itemsize

    def read(self, names: list[str]) -> dict[str, Tensor]:
        """The whole tensors ``names`` (the model's own), the adapted ones merged."""
        sources: dict[str, tuple[str, ...]] = {}
        for name in names:
            layer = self._layer_of(name)
            sources[name] = (f"{layer}.base_layer.weight", *adapter_names(layer)) if layer else (name,)
        read = self.ckpt.read(sorted({s for group in sources.values() for s in group}))
        out = {}
        for name, group in sources.items():
            if len(group) == 1:
                out[name] = read[group[0]]
            else:
                weight, a, b = (read[s] for s in group)
                out[name] = merged(weight, a, b, self.lora.scaling, self._conv1d)
        return out

    def _layer_of(self, name: str) -> str | None:
        """The adapted layer whose weight ``name`` is (``...q_proj`` for ``...q_proj.weight``), else ``None``."""
        layer = name.removesuffix(".weight")
        return layer if layer != name and layer in self._adapted else None


def export_adapter(ckpt: Any, lora: LoraConfig, out: Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``ckpt``'s adapters as a peft adapter folder (see the module docstring).

    Raises:
        ValueError: The checkpoint's model has no HuggingFace names for its adapted layers (the built-in GPT with
            ``arch=gpt2``, whose fused ``c_attn`` has no per-projection layer): export it with ``--merge``.
    """
    import peft  # optional dependency: lightning-dist[hf]
    from safetensors.torch import save_file

    layers = adapted_layers(ckpt.names)
    hf_names = hf_layer_names(ckpt.hyper_parameters, layers)
    tensors = {}
    read = ckpt.read([name for layer in layers for name in adapter_names(layer)])
    for layer in layers:
        for which, name in zip("AB", adapter_names(layer)):
            tensor = read[name]
            tensor = tensor if dtype is None else tensor.to(dtype)
            tensors[peft_adapter_name(hf_names[layer], which)] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    source = ckpt.hyper_parameters.get("hf_source")
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(hf_names.values()),
        fan_in_fan_out=_is_conv1d(ckpt.hyper_parameters),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=source,
    )
    config.save_pretrained(str(out))
    return out


def hf_layer_names(hp: dict[str, Any], layers: list[str]) -> dict[str, str]:
    """Each adapted layer's name in the HuggingFace model the export writes (``model.`` prefix dropped; the built-in
    GPT's layers by the Llama names its export uses)."""
    if "hf_config" in hp:
        return {layer: layer[len(MODULE_ATTR) :] for layer in layers}
    gpt = GPTConfig(**hp["model"])
    renamed = {
        MODULE_ATTR + c.sources[0][: -len(".weight")]: c.name[: -len(".weight")]
        for c in hf_tensors(gpt)
        if c.combine is same and len(c.sources) == 1 and c.name.endswith(".weight")
    }
    missing = [layer for layer in layers if layer not in renamed]
    if missing:
        raise ValueError(
            f"{missing[0]} has no single HuggingFace layer (model.arch={gpt.arch}: its projections are fused); export "
            "the merged model with --merge instead of the adapter."
        )
    return {layer: renamed[layer] for layer in layers}


def _is_conv1d(hp: dict[str, Any]) -> bool:
    """Whether the adapted layers are transformers' ``Conv1D`` (GPT-2 under model=hf), stored (in, out)."""
    return (hp.get("hf_config") or {}).get("model_type") == "gpt2"


def describe(out: Path) -> str:
    """One line on an adapter folder: its rank and how many layers it adapts."""
    config = json.loads((out / "adapter_config.json").read_text())
    return f"peft adapter: rank {config['r']}, {len(config['target_modules'])} layers"
