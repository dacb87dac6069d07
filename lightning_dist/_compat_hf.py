"""Every private transformers API lightning-dist touches (the transformers part of ``_compat.py``, which re-exports
these names: callers write ``_compat.attn_implementation``).

When one of these moves in a new transformers release, this is the only file to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def set_attn_implementation(config: Any, name: str) -> None:
    """Make models built from the transformers ``config`` use the attention implementation ``name`` (``"sdpa"``...).

    transformers (4.x to 5.x) has no public setter: ``from_pretrained`` sets the private ``_attn_implementation``."""
    config._attn_implementation = name


def attn_implementation(config: Any, default: str = "sdpa") -> str:
    """The attention implementation the transformers ``config`` asks for (its private ``_attn_implementation``);
    ``default`` where the config has no such attribute."""
    return getattr(config, "_attn_implementation", default)


def hf_init_weights(model: Any, module: nn.Module) -> None:
    """A transformers model's own initialization rule applied to ``module`` alone: ``PreTrainedModel._init_weights``
    (an override point every family defines or inherits; transformers calls it on every module after a build)."""
    model._init_weights(module)


def hf_no_split_modules(model: Any) -> set[str]:
    """The class names of the modules transformers never splits across devices (its decoder layers): the private
    ``_no_split_modules`` of a ``PreTrainedModel`` (empty when it has none)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def hf_supported_attention(model_class: type) -> set[str]:
    """The attention implementations a transformers model class declares it supports: ``eager`` always, and
    ``sdpa`` / ``flash_attention_2`` / ``flex_attention`` by its private ``_supports_sdpa`` / ``_supports_flash_attn``
    / ``_supports_flex_attn`` flags (transformers 4.4x to 5.x)."""
    flags = {
        "sdpa": "_supports_sdpa",
        "flash_attention_2": "_supports_flash_attn",
        "flex_attention": "_supports_flex_attn",
    }
    return {"eager"} | {name for name, flag in flags.items() if getattr(model_class, flag, False)}
