"""The chunked loss of a transformers causal LM (``parallelism.loss_chunks``): its final hidden states to the head
piece by piece (:func:`lightning_dist.models.loss.chunked_token_loss`), never the whole ``(B, T, V)`` logits.

The model runs through its own ``forward`` (so FSDP2's and TP's hooks on it run as usual) with ``logits_to_keep=1``,
the last position's logits only; a forward hook on its decoder catches ``last_hidden_state`` (after the final norm).
What the model does to its head's output before the loss (Cohere's ``logit_scale``, Gemma 2's soft-capping) is done to
each piece. No distributed code here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_dist.models.loss import chunked_token_loss


def hf_chunked_loss(
    model: nn.Module, inputs: Tensor, targets: Tensor, chunks: int, scale: Tensor | None = None
) -> Tensor:
    """The next-token loss of ``model`` on ``inputs`` (token ids) against ``targets``, the head applied in ``chunks``
    pieces; ``scale`` as :func:`~lightning_dist.models.loss.token_loss`'s (masked data)."""
    caught: list[Tensor] = []
    hook = model.base_model.register_forward_hook(lambda _m, _a, out: caught.append(out.last_hidden_state))
    try:
        model(input_ids=inputs, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    head = model.get_output_embeddings()
    return chunked_token_loss(caught[0], head, targets, chunks, scale, logits_fn=logits_fn(model.config))


def logits_fn(config: Any) -> Any:
    """What a transformers causal LM does to its head's output before the loss: Cohere's ``logit_scale``, Gemma 2's
    ``final_logit_softcapping``; ``None`` for the rest (Llama, Qwen2, Mistral, GPT-2)."""
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale is None and cap is None:
        return None

    def apply(logits: Tensor) -> Tensor:
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply
