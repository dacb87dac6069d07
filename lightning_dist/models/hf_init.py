"""Building a transformers causal LM on the meta device, and giving any part of it its one-process values.

:func:`build_causal_lm` makes the model on the meta device (nothing allocated, nothing drawn); a strategy shards it or
splits it into stages, each rank allocates its own part, and :func:`init_causal_lm` fills that part with the values
transformers' own build gives, by transformers' own rule: the model's ``_init_weights`` (each family's: Gemma's norms
at zero and its embedding scale, GPT-2's scaled residual projections, rotary ``inv_freq`` tables, any non-persistent
buffer its init sets). It runs on a CPU *twin* of each unit of the model (a decoder layer, the embedding, the final
norm, the head, ...: the same subtree in every layout), whose tensors are whole fp32 copies with the global shapes,
under a generator seeded by the module's name; each real tensor (a shard, a pipeline stage's) then takes its slice.
So the values depend only on the seed, the names and the shapes, and the distributions are transformers' own; the
random numbers are not transformers' (theirs come from the global generator in module order, which no sharded rank
can reproduce). A tensor that the model's rule leaves unset is an error naming it, never left as it was.

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from lightning_dist import _compat
from lightning_dist.models.whole import copy_whole


def causal_lm_class(config: Any) -> type[nn.Module]:
    """The transformers causal-LM class of ``config`` (``LlamaConfig`` -> ``LlamaForCausalLM``).

    Raises:
        ValueError: transformers has no causal LM for this config (one line).
    """
    import transformers  # optional dependency: lightning-dist[hf]

    try:
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(
            f"{type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}) has no causal-LM class in "
            "transformers; use a decoder-only model (Llama, Qwen2, Mistral, GPT-2, ...)."
        ) from None


def build_causal_lm(config: Any) -> nn.Module:
    """The causal LM of ``config`` on the meta device, in the current default dtype (the precision's).

    ``config.dtype`` (``torch_dtype``) is not applied: Lightning's precision decides the parameters' dtype.
    """
    with torch.device("meta"):  # transformers skips its initialization on the meta device
        return causal_lm_class(config)(config)


def retie(model: nn.Module) -> None:
    """Make the output head the input embedding's matrix again (``tie_word_embeddings``) where both are held.

    ``to_empty`` gives each module its own new tensor, so a tie must be made again after materializing.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and head is not None and head.weight is not embedding.weight:
        head.weight = embedding.weight


@torch.no_grad()
def init_causal_lm(model: nn.Module, seed: int, random: bool = True) -> None:
    """Give every parameter and buffer ``model`` holds the value transformers' own build gives it (see the module
    docstring), seeded by name, whatever part of the model this rank holds.

    Args:
        model: The transformers model (whole, sharded, or a pipeline stage's pruned copy).
        seed: Base seed.
        random: ``False`` when every weight is read right after (a pretrained folder, a checkpoint): the parameters
            are only zeroed (a memset instead of drawing the whole model on every rank); the buffers are set as
            ever (a non-persistent one, Gemma's ``embed_scale`` or a rotary table, is in no checkpoint).

    Raises:
        ValueError: The model's ``_init_weights`` leaves a tensor unset (one line naming it).
    """
    retie(model)
    done: set[int] = set()  # a tied weight is set once, by its first owner in module order (as in one process)
    for unit_name, unit, whole in _units(model):
        twin, pairs = _twin(unit, whole, random, done)
        if not pairs:
            continue
        modules = list(twin.named_modules())
        for name, module in reversed(modules):  # children first, then the parent's rule (nn.Module.apply's order)
            # On the CPU whatever the default device (Lightning's init context makes it CUDA): a rule that builds a
            # table without naming a device (transformers' rotary init) builds it beside the twin.
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                full = f"{unit_name}.{name}".strip(".")
                torch.manual_seed(zlib.crc32(f"{seed}:{full}".encode()))  # one string: the generator keeps 32 bits
                _compat.hf_init_weights(model, module)
        for name, real, value in pairs:
            if value is None:  # a parameter whose value is read next: zeroed
                real.zero_()
            elif _unset(value):
                raise ValueError(
                    f"{type(model).__name__}: {unit_name}.{name} is not set by the model's _init_weights "
                    "(transformers), so a model built on the meta device cannot be given its values; pass the built "
                    "model to HFCausalLM instead of its config (its values are then kept)."
                )
            else:
                copy_whole(real, value)


def _units(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(name, module, whole)`` covering ``model`` once: each module on the path to the decoder layers' container
    (the container, the decoder, the model) with its own tensors only, and every other module right below them as a
    whole subtree (a decoder layer, the embedding, the final norm, the head). A pipeline stage holds whole units only,
    so each unit is initialized alike in every layout."""
    container = decoder_layers_path(model)
    parts = container.split(".") if container else []
    path = {".".join(parts[:i]) for i in range(len(parts) + 1)}
    units = []
    for name, module in model.named_modules():
        if name in path:
            units.append((name, module, False))
        elif name.rpartition(".")[0] in path:
            units.append((name, module, True))
    return units


def decoder_layers_path(model: nn.Module) -> str:
    """The name of the container of the decoder layers: the module list holding a class ``_no_split_modules`` names
    (transformers' unit of device placement), else the longest module list ("" when there is none)."""
    names = _compat.hf_no_split_modules(model)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    for name, container in lists:
        if any(type(child).__name__ in names for child in container.children()):
            return name
    return max(lists, key=lambda item: len(item[1]), default=("", model))[0]


def _twin(module: nn.Module, whole: bool, random: bool, done: set[int], prefix: str = "") -> tuple[nn.Module, list]:
    """A CPU copy of ``module`` (of its whole subtree when ``whole``, else with no children) whose own tensors are new
    whole fp32 tensors holding a sentinel, and ``(name, real, twin tensor)`` for each real tensor not set yet. With
    ``random=False`` the parameters stay on the meta device in the twin (nothing is drawn) and pair with ``None``."""
    twin = _compat.shallow_clone(module)
    pairs: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    children = _compat.module_children(twin)
    for name, child in list(children.items()):
        if child is not None and whole:
            children[name], below = _twin(child, True, random, done, f"{prefix}{name}.")
            pairs += below
        else:
            children[name] = None  # a path module's rule must not reach the real modules below it
    own = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
    own += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
    for name, real, is_param in own:
        if id(real) in done:
            continue
        done.add(id(real))
        fresh = torch.empty(tuple(real.shape), device="meta") if is_param and not random else _sentinel(real)
        setattr(twin, name, nn.Parameter(fresh, requires_grad=False) if is_param else fresh)
        pairs.append((prefix + name, real, None if fresh.is_meta else fresh))
    return twin, pairs


def _sentinel(real: torch.Tensor) -> torch.Tensor:
    """A whole (global-shape) CPU tensor to initialize in place of ``real``: fp32 NaNs for floating point, the
    smallest integer otherwise, so that what the model's rule leaves unset shows."""
    shape = tuple(real.shape)  # a DTensor's is the global shape
    if real.is_floating_point():
        return torch.full(shape, float("nan"), device="cpu")
    if real.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool, device="cpu")
    return torch.full(shape, torch.iinfo(real.dtype).min, dtype=real.dtype, device="cpu")


def _unset(value: torch.Tensor) -> bool:
    if value.is_floating_point():
        return bool(torch.isnan(value).any())
    if value.dtype == torch.bool:
        return False  # no sentinel value: a boolean buffer's rule is trusted
    return bool((value == torch.iinfo(value.dtype).min).any())
