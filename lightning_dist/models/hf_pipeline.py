"""A transformers causal LM cut into pipeline stages, each stage running the model's own forward.

The layout is read off the model, for any family: its decoder (``model.<base_model_prefix>``: ``model``,
``transformer``, ``gpt_neox``, ...), the container of its decoder layers (the module list of the classes
transformers never splits, ``_no_split_modules``), the decoder's parts with parameters registered before the layers
(embeddings: the first stage's) and after them (the final norm, with or without parameters: the last stage's, with
the output head); the rotary embedding (buffers only) and dropout before the layers stay on every stage.

A stage then runs the family's own code, so what a family adds comes with it: embedding scales and multipliers,
logit scaling and soft-capping, per-layer attention types and sliding windows, the masks. A stage after the first
calls the decoder with placeholder token ids (its embeddings answer zeros) and a hook puts the previous stage's
hidden states in front of its first layer; a stage before the last has an identity for a final norm and returns the
decoder's hidden states; the last stage runs the causal LM's whole forward (head and logit processing). The decoder's
config on a stage lists the per-layer settings of its own layers only (``layer_types``: transformers indexes them by
the loop's position). Whether this is exact for a family is what ``tests/foreign/test_hf_families.py`` measures; the
family matrix in ``docs/hf.md`` is its record.

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dist import _compat
from lightning_dist.models.hf_init import decoder_layers_path


@dataclass(frozen=True)
class HFLayout:
    """Where a causal LM's parts are, by attribute path from the model (``LlamaForCausalLM``)."""

    decoder: str  # "model"
    blocks: str  # "model.layers"
    first: tuple[str, ...]  # ("model.embed_tokens",)
    last: tuple[str, ...]  # ("model.norm", "lm_head")


def hf_layout(model: nn.Module) -> HFLayout:
    """Read the layout of the transformers causal LM ``model`` (see the module docstring).

    Raises:
        ValueError: A layout the stage forward cannot run: no decoder-layer container right under the decoder, or
            parameters outside the decoder besides the output head (one line naming them).
    """
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", "") or ""
    decoder = getattr(model, prefix, None) if prefix else None
    blocks = decoder_layers_path(model)
    if not isinstance(decoder, nn.Module) or blocks.rpartition(".")[0] != prefix:
        raise ValueError(
            f"{name}: its decoder layers ({blocks or 'none found'}) are not a list right under its decoder "
            f"({prefix or 'none'}), so its own forward cannot run one pipeline stage; use pp=1 with it."
        )
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    others = [n for n, m in model.named_children() if n not in (prefix, head_name) and _has_parameters(m)]
    if others:
        raise ValueError(
            f"{name} has parts with parameters outside its decoder and head ({', '.join(others)}), which no pipeline "
            "stage would run; use pp=1 with it."
        )
    first, last, seen = [], [], False
    container = blocks.rpartition(".")[2]
    for child, module in decoder.named_children():
        if child == container:
            seen = True
        elif _has_parameters(module):
            (last if seen else first).append(f"{prefix}.{child}")
        elif seen and not any(True for _ in module.buffers()):
            last.append(f"{prefix}.{child}")  # a final norm without parameters (OLMo's): not on earlier stages
        # else: kept on every stage: tables (the rotary embedding's buffers), dropout before the layers
    return HFLayout(prefix, blocks, tuple(first), (*last, *([head_name] if head_name else [])))


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def hf_stage_forward(
    self: nn.Module, hidden: Tensor, position_ids: Tensor | None = None, *, layout: HFLayout | None = None
) -> Tensor:
    """One pipeline stage of a transformers causal LM (``self``: the stage's view of the model), by its own forward.

    Args:
        hidden: Token ids (B, T) on the first stage; else the previous stage's hidden states (B, T, C).
        position_ids: (1, T) positions of the tokens (context parallelism passes this rank's global ones); ``None``:
            the model's own default (``0..T-1``).
        layout: The whole model's :func:`hf_layout` (bound by ``HFCausalLM.pipeline_spec``).

    Returns:
        Logits (B, T, V) on the last stage, else hidden states (B, T, C).
    """
    stage = _StageParts.of(self, layout)
    if stage.first:
        ids = hidden
    else:
        ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    stage.incoming = None if stage.first else hidden
    try:
        if stage.last:  # the causal LM's forward: the decoder, then the head and what the family does to logits
            return type(self).forward(self, **kwargs).logits
        return stage.decoder(**kwargs).last_hidden_state
    finally:
        stage.incoming = None


class _StageParts:
    """What one stage view needs to run its model's forward, made once per view: zeros for the embeddings it lacks,
    identities for the final parts it lacks, the decoder's config restricted to its layers, and the hook that puts
    the incoming hidden states in front of its first layer."""

    def __init__(self, view: nn.Module, layout: HFLayout) -> None:
        self.decoder: nn.Module = view.get_submodule(layout.decoder)
        self.first = all(_present(view, name) for name in layout.first)
        self.last = all(_present(view, name) for name in layout.last)
        self.incoming: Tensor | None = None
        width = self.decoder.config.hidden_size
        for name in layout.first if not self.first else ():
            _set(view, name, _Zeros(width, self))
        for name in layout.last if not self.last else ():
            if name.startswith(f"{layout.decoder}."):
                _set(view, name, nn.Identity())
        blocks = _compat.module_children(view.get_submodule(layout.blocks))
        self.decoder.config = _stage_config(self.decoder.config, [int(key) for key in blocks])
        first_block = next(iter(blocks.values()))
        # On the block itself (the view shares it with the model): a no-op outside this stage's forward. Prepended:
        # before FSDP2's pre-forward hook, which then casts the hidden states like any input.
        first_block.register_forward_pre_hook(self._take_incoming, with_kwargs=True, prepend=True)

    @staticmethod
    def of(view: nn.Module, layout: HFLayout | None) -> _StageParts:
        """The view's parts, made on its first forward (kept in its ``__dict__``: not a module attribute)."""
        parts = view.__dict__.get("lightning_dist_stage")
        if parts is None:
            if layout is None:
                raise ValueError("hf_stage_forward needs the whole model's layout: bind it with functools.partial.")
            parts = view.__dict__["lightning_dist_stage"] = _StageParts(view, layout)
        return parts

    def _take_incoming(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.incoming is None:
            return None
        if args:
            return (self.incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.incoming}


class _Zeros(nn.Module):
    """An embedding a stage does not hold: zeros of the incoming hidden states' dtype (the hook replaces them)."""

    def __init__(self, width: int, stage: _StageParts) -> None:
        super().__init__()
        self.width, self.stage = width, [stage]  # a list: not registered as a child module

    def forward(self, ids: Tensor) -> Tensor:
        incoming = self.stage[0].incoming
        return torch.zeros(*ids.shape, self.width, dtype=incoming.dtype, device=incoming.device)


def _stage_config(config: Any, layers: list[int]) -> Any:
    """A copy of the decoder's config whose per-layer lists (``layer_types``, ...: as long as the model has layers)
    hold the entries of ``layers`` only, in order, and whose layer count is theirs."""
    stage = copy.copy(config)
    total = config.num_hidden_layers
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == total and key != "architectures":
            setattr(stage, key, type(value)(value[i] for i in layers))
    stage.num_hidden_layers = len(layers)
    return stage


def _present(view: nn.Module, name: str) -> bool:
    """Whether the view holds the part ``name`` (not ``None``, as the stage split leaves what it does not own)."""
    parent, _, child = name.rpartition(".")
    owner = view.get_submodule(parent) if parent else view
    return _compat.module_children(owner).get(child) is not None


def _set(view: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    owner = view.get_submodule(parent) if parent else view
    _compat.module_children(owner)[child] = module
