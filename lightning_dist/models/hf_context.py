"""How a HuggingFace causal LM takes part in context parallelism, through transformers' attention hook.

transformers calls the attention function registered under ``config._attn_implementation`` with ``q`` / ``k`` / ``v``
already RoPE-rotated, (B, H, T, D). Before the strategy applies context parallelism (``parallel/context.py``), the
spec's ``prepare`` registers :func:`cp_attention_forward` as :data:`CP_ATTENTION`, switches this model instance to it
(``set_attn_implementation``) and gives every ``self_attn`` the attribute :data:`ATTRIBUTE`, which the strategy then
fills with its cp attention (all-gather of K/V, causal by global position). The spec also names the model whose
``forward`` takes ``position_ids``: the strategy passes this rank's global positions, so the rotary embedding
rotates each token by its place in the whole sequence (HF would use ``arange(T_local)``). transformers builds no mask
for an attention function it has no mask builder for, so HF's local causal mask never reaches it.
Both are undone with the rest of the cp changes when the strategy tears down (``undo_context_parallel``).

No modeling code is copied, no distributed code here. Needs the optional extra ``lightning-dist[hf]``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_dist import _compat
from lightning_dist.parallel.context import ContextParallelSpec, apply_change

#: The name :func:`cp_attention_forward` is registered under in transformers' ``AttentionInterface``.
CP_ATTENTION = "lightning_dist_cp"
#: The attribute of each attention module that holds the strategy's cp attention ``(q, k, v, scale=) -> out``.
ATTRIBUTE = "context_parallel_attention"
#: Config fields of attention the cp attention (plain causal attention, positions by ``position_ids``) does not do,
#: each with why: a model whose config sets one is refused before launch.
UNSUPPORTED = {
    "attn_logit_softcapping": "soft-capped attention scores",
    "alibi": "ALiBi position biases (no position_ids to split)",
    "use_alibi": "ALiBi position biases (no position_ids to split)",
    "position_embedding_type": "learned absolute position embeddings",
}


def check_context_parallel(config: Any, cp: int) -> None:
    """Raise a one-line ``ValueError`` when ``cp`` cannot split the sequences of the model of this transformers
    ``config``: the cp attention is causal attention over global positions (rotary ones, given by ``position_ids``),
    without sliding windows, soft-capping, position biases or dropout. The family matrix (``docs/hf.md``) says which
    families equal one process under cp."""
    if cp == 1:
        return
    model_type = getattr(config, "model_type", None)
    for key, what in UNSUPPORTED.items():
        value = getattr(config, key, None)
        if value not in (None, False, 0, 0.0, "rope", "rotary"):
            raise ValueError(
                f"cp={cp} with a HuggingFace {model_type!r} model ({key}={value}: {what}): the cp attention is plain "
                "causal attention; set cp=1."
            )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = window is not None and (not layer_types or "sliding_attention" in layer_types)
    if sliding and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"cp={cp} with sliding_window={window}: the cp attention is full causal attention; set the model "
            "config's sliding_window=None, or cp=1."
        )
    dropout = getattr(config, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(f"cp={cp} with attention_dropout={dropout}: the cp attention has none; set it to 0, or cp=1.")


def hf_context_parallel_spec(model: nn.Module, blocks: str, prefix: str) -> ContextParallelSpec:
    """The attention modules and the ``position_ids`` taker of the transformers causal LM ``model`` at ``prefix``
    (``"model."`` inside ``HFCausalLM``); ``blocks``: the path of its decoder-layer list in it."""
    pattern = attention_modules(model, blocks)
    return ContextParallelSpec(
        attention=(prefix + pattern,),
        attention_attr=ATTRIBUTE,
        position_ids=prefix.rstrip("."),  # "": the module itself
        prepare=functools.partial(route_attention, path=prefix.rstrip("."), pattern=pattern),
    )


def attention_modules(model: nn.Module, blocks: str) -> str:
    """The pattern of the attention modules of ``model``'s decoder layers (``model.layers.*.self_attn``): the child
    of a layer whose class is an ``...Attention``.

    Raises:
        ValueError: The layers have no such child (one line).
    """
    layer = next(iter(model.get_submodule(blocks).children()))
    for name, child in layer.named_children():
        if type(child).__name__.endswith("Attention"):
            return f"{blocks}.*.{name}"
    raise ValueError(
        f"{type(model).__name__}'s decoder layers ({type(layer).__name__}) have no attention module (a child whose "
        "class ends in Attention) for the cp attention to take; set cp=1."
    )


def route_attention(module: nn.Module, path: str = "", pattern: str = "model.layers.*.self_attn") -> None:
    """Make the transformers model at ``path`` in ``module`` (this instance) call :func:`cp_attention_forward`, which
    calls each attention module's :data:`ATTRIBUTE` (``None`` until the strategy fills it). Recorded as a change of
    context parallelism: undone with it, the model runs its own attention implementation again."""
    import transformers  # optional dependency: lightning-dist[hf]

    transformers.AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
    apply_change(module.get_submodule(path), functools.partial(_route, pattern=pattern))


def _route(model: nn.Module, pattern: str) -> Callable[[nn.Module], None]:
    previous = _compat.attn_implementation(model.config)
    added = [
        child
        for name, child in model.named_modules()
        if fnmatch.fnmatchcase(name, pattern) and not hasattr(child, ATTRIBUTE)
    ]
    for child in added:
        setattr(child, ATTRIBUTE, None)
    model.set_attn_implementation(CP_ATTENTION)

    def undo(model: nn.Module) -> None:
        for child in added:
            delattr(child, ATTRIBUTE)
        model.set_attn_implementation(previous)

    return undo


def cp_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature around ``module``'s cp attention: ``query`` (B, H, T_local, D),
    ``key`` / ``value`` (B, K, T_local, D), RoPE-rotated -> ((B, T_local, H, D), no weights). Causal over the global
    positions; ``attention_mask`` must be ``None`` (HF's mask is local; the cp attention masks by global position)."""
    attention = getattr(module, ATTRIBUTE, None)
    if attention is None:
        raise ValueError(
            f"{type(module).__name__} runs attn_implementation={CP_ATTENTION!r} without a cp attention; train it "
            "under a strategy with cp > 1, or call model.set_attn_implementation('sdpa')."
        )
    if attention_mask is not None:
        raise ValueError(
            f"cp attention got an attention_mask of shape {tuple(attention_mask.shape)}: padding masks are not split "
            "over cp; pass no attention_mask (pack sequences without padding), or set cp=1."
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"cp attention got keys of {key.shape[2]} positions for queries of {query.shape[2]}: a KV cache is not "
            "split over cp; call the model with use_cache=False, or set cp=1."
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"cp attention got sliding_window={kwargs['sliding_window']}: it is full causal attention; set the model "
            "config's sliding_window=None, or cp=1."
        )
    if dropout or not getattr(module, "is_causal", True):
        raise ValueError(
            f"cp attention got dropout={dropout}, is_causal={getattr(module, 'is_causal', True)}: it is causal "
            "attention without dropout; set attention_dropout=0, or cp=1."
        )
    out = attention(query, key, value, scale=scaling)  # (B, H, T_local, D)
    return out.transpose(1, 2).contiguous(), None
