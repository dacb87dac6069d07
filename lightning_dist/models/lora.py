"""LoRA through peft: adapters injected into a model, given their one-process values, and read back for export.

:func:`apply_lora` puts peft's LoRA layers in place of the targeted linear layers (``inject_adapter_in_model``: the
model's class and forward are unchanged; a targeted ``q_proj`` becomes a peft ``Linear`` holding the original layer as
``q_proj.base_layer`` and the adapters as ``q_proj.lora_A.default`` / ``q_proj.lora_B.default``) and freezes every
other parameter, so the optimizer holds the adapters only; on a 16-bit base (``bf16-true``) the adapters are float32
(peft's own default), so their updates are not rounded away. It runs on the meta device like the rest of the build;
:func:`init_lora` then gives each adapter its value by name (peft's distributions: A Kaiming-uniform, B zeros), so
every layout starts from the one-process adapters. The tensor-parallel styles of the adapters follow their base
layer's (``lightning_dist/parallel/lora.py``).

The names peft adds are the only change to the model's names: :func:`base_name` maps them back to the model's own
(HuggingFace folders hold ``q_proj.weight``), :func:`merged` folds trained adapters into their weights, and
:func:`peft_adapter_name` gives the names peft's ``PeftModel.from_pretrained`` reads.

Needs peft (``lightning-dist[hf]``). No distributed code here.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_dist.models.lora_config import LoraConfig
from lightning_dist.models.whole import copy_whole

ADAPTER = "default"  #: peft's adapter name (a single adapter per model)
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")
_BASE = ".base_layer."
_HALF = (torch.bfloat16, torch.float16)
T = TypeVar("T")


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA adapter's (``...q_proj.lora_A.default.weight``)."""
    return any(part in name for part in _ADAPTER_PARTS)


def base_name(name: str) -> str:
    """The model's own name of a parameter peft moved under ``base_layer`` (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``); any other name unchanged."""
    return name.replace(_BASE, ".")


def _linear_like(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer stored transposed; peft adapts it (fan_in_fan_out).
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def resolve_targets(model: nn.Module, targets: Iterable[str] | None, blocks: str) -> list[str]:
    """The names of the linear layers of ``model`` that ``targets`` picks (by full name or name suffix, as peft
    matches); ``None``: every linear layer below ``blocks`` (the decoder layers).

    Raises:
        ValueError: A target matching no layer, or a layer that is not linear (one line naming it).
    """
    names = {name: module for name, module in model.named_modules() if name}
    if targets is None:
        prefix = f"{blocks}." if blocks else ""
        found = [name for name, module in names.items() if name.startswith(prefix) and _linear_like(module)]
        if not found:
            raise ValueError(f"{type(model).__name__} has no linear layer under {blocks!r}; give model.lora.targets.")
        return found
    found = []
    for target in targets:
        matches = [name for name in names if name == target or name.endswith(f".{target}")]
        if not matches:
            sample = ", ".join(sorted({n.rpartition(".")[2] for n, m in names.items() if _linear_like(m)})[:10])
            raise ValueError(
                f"model.lora.targets: {target!r} names no layer of {type(model).__name__}; its linear layers are "
                f"named {sample}."
            )
        for name in matches:
            if not _linear_like(names[name]):
                raise ValueError(
                    f"model.lora.targets: {name} is a {type(names[name]).__name__}; LoRA here adapts linear layers "
                    "only (attention and MLP projections, the head); leave it out of the targets."
                )
            if name not in found:
                found.append(name)
    return found


def apply_lora(model: nn.Module, cfg: LoraConfig, blocks: str) -> list[str]:
    """Inject LoRA adapters into ``model`` in place (on whatever device it is, the meta device included) and freeze
    every parameter but theirs; returns the adapted layers' names.

    Args:
        model: The network (``GPT``, a transformers causal LM).
        cfg: ``model.lora``; ``cfg.enabled`` must be true.
        blocks: Path of the decoder-layer container in ``model`` (the default targets are its linear layers).
    """
    import peft  # optional dependency: lightning-dist[hf]

    targets = resolve_targets(model, cfg.targets, blocks)
    conv1d = any(type(model.get_submodule(name)).__name__ == "Conv1D" for name in targets)
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        fan_in_fan_out=conv1d,
    )
    on_meta = any(param.is_meta for param in model.parameters())  # adapters made there too: nothing drawn
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    for name, module in model.named_modules():
        # A 16-bit base (cluster.precision=bf16-true) keeps float32 adapters, as peft's PeftModel does by default
        # (autocast_adapter_dtype): a bf16 adapter rounds away AdamW updates below half its last bit (at lr 2e-4,
        # most of A's entries never moved). peft's forward casts the input to the adapter's dtype and the sum back.
        if name.endswith((f".lora_A.{ADAPTER}", f".lora_B.{ADAPTER}")) and module.weight.dtype in _HALF:
            module.to(torch.float32)
    return targets


def to_keeping_adapters(to: Callable[..., T], model: nn.Module, *args: Any, **kwargs: Any) -> T:
    """``to(*args, **kwargs)``, a module's ``nn.Module.to`` over ``model``, except that a conversion to a 16-bit dtype
    (Lightning's ``bf16-true`` converts the whole module so, after the strategy built and sharded it) leaves the
    float32 adapters (:func:`apply_lora`) float32, moved to the device asked for if any. They are left out of the
    conversion rather than converted back: a round trip through bf16 would round their values."""
    device, dtype = _to_arguments(*args, **kwargs)
    if dtype not in _HALF:
        return to(*args, **kwargs)
    kept = [
        (holder, module)
        for name, holder in model.named_modules()
        if name.endswith((".lora_A", ".lora_B"))
        if isinstance(module := holder[ADAPTER], nn.Module) and module.weight.dtype == torch.float32
    ]
    for holder, _ in kept:  # out of the module tree while it converts (ModuleDict entries: public API)
        holder[ADAPTER] = nn.Identity()
    try:
        out = to(*args, **kwargs)
    finally:
        for holder, module in kept:
            holder[ADAPTER] = module
    if device is not None:
        for _, module in kept:
            module.to(device)
    return out


def _to_arguments(*args: Any, **kwargs: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype a call ``nn.Module.to(*args, **kwargs)`` asks for (None: not asked)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, Tensor):
            device, dtype = arg.device, arg.dtype
        elif isinstance(arg, (str, int, torch.device)) and not isinstance(arg, bool):  # not non_blocking
            device = arg
    return (torch.device(device) if device is not None else None), dtype


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Give every adapter ``model`` holds (whole, sharded or a pipeline stage's) its one-process value: A drawn
    Kaiming-uniform (peft's ``a=sqrt(5)``) whole on the CPU from a generator seeded by its name, B zeros; each rank
    keeps its slice."""
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            param.zero_()
        elif ".lora_A." in name:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(zlib.crc32(f"{seed}:lora:{name}".encode()))  # one string: 32 bits are kept
            value = torch.empty(tuple(param.shape), device="cpu")
            bound = _kaiming_uniform_bound(value, a=math.sqrt(5))
            value.uniform_(-bound, bound, generator=generator)
            copy_whole(param, value)


def _kaiming_uniform_bound(tensor: Tensor, a: float) -> float:
    """The bound of ``nn.init.kaiming_uniform_(tensor, a)`` (fan-in mode, leaky-ReLU gain)."""
    fan_in = tensor.shape[1]
    gain = math.sqrt(2.0 / (1 + a**2))
    return math.sqrt(3.0) * gain / math.sqrt(fan_in)


def adapted_layers(names: Iterable[str]) -> list[str]:
    """The layers that hold an adapter, by the parameter names of a model or checkpoint (``...q_proj``)."""
    layers: list[str] = []
    for name in names:
        if ".lora_A." in name:
            layer = name.split(".lora_A.")[0]
            if layer not in layers:
                layers.append(layer)
    return layers


def adapter_names(layer: str) -> tuple[str, str]:
    """The parameter names of ``layer``'s adapter pair: ``(A, B)``."""
    return f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"


def merged(weight: Tensor, a: Tensor, b: Tensor, scaling: float, fan_in_fan_out: bool = False) -> Tensor:
    """``weight + scaling * B @ A`` (what peft's ``merge_and_unload`` computes), in float32, in ``weight``'s dtype.

    ``fan_in_fan_out``: the weight is stored (in, out) (transformers' ``Conv1D``), so the update is transposed."""
    delta = scaling * (b.float() @ a.float())
    return (weight.float() + (delta.T if fan_in_fan_out else delta)).to(weight.dtype)


def peft_adapter_name(layer: str, which: str) -> str:
    """The key peft's adapter files use for ``layer``'s A or B (``which``): ``base_model.model.<layer>.lora_A.weight``
    (``layer`` in the HuggingFace model's names)."""
    return f"base_model.model.{layer}.lora_{which}.weight"
