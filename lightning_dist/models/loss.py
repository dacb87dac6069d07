"""The next-token loss of the built-in GPT and of ``HFCausalLM``, token-exact under every split of the global batch.

Unmasked batches ``(inputs, targets)``: the mean cross-entropy of the micro batch (every target counts, so the mean of
equal micro batches is the global batch's mean).

Masked batches ``(inputs, targets, norm)`` (data=hf ``instruction`` / ``chat``; ``norm`` (B, 2) int64, each row the
global batch's ``(G, N)``: its samples and its target tokens, see ``lightning_dist/data/token_norm.py``): the loss of a
micro batch of ``B`` samples is ``sum(ce) * scale / B`` with ``scale = G / N``. Lightning's accumulation, the pipeline
schedule (``scale_grads``), DDP / FSDP2 and the logged loss all average micro-batch losses, ``G / B`` of them in all,
so every layout, micro batch and schedule gives ``sum over the global batch of ce / N``: the one-process token mean.
The pair travels as integers because a precision plugin (``bf16-true``) casts a batch's float tensors to bf16.
``scale`` is one number per batch (the step's), so the loss takes the sum over the whole micro batch
(``reduction="sum"``, which loss parallelism supports on vocab-sharded DTensor logits).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

#: The target of a token without loss (``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100


def token_loss(logits: Tensor, targets: Tensor, scale: Tensor | None = None) -> Tensor:
    """Next-token cross-entropy in float32 over the targets that are not ``-100``: their mean (``scale=None``), or
    ``sum * scale / B`` (``scale``: the step's ``G / N``, a 0-dim tensor or one equal value per sample)."""
    if scale is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total * (scale.reshape(-1)[0] / targets.shape[0])


def loss_scale(norm: Tensor) -> Tensor:
    """``G / N`` (0-dim float32) from a batch's ``norm`` rows ``(G, N)`` (the same in every row of a batch)."""
    if norm.ndim != 2 or norm.shape[1] != 2 or norm.is_floating_point():
        raise ValueError(
            f"the third element of a (inputs, targets, norm) batch must be an integer (B, 2) tensor of the global "
            f"batch's samples and target tokens; got {norm.dtype} {tuple(norm.shape)}"
        )
    return norm[0, 0].float() / norm[0, 1].float()


def split_token_batch(batch: Any) -> tuple[Any, Tensor] | tuple[Any, Tensor, dict[str, Tensor]]:
    """``(inputs, targets)`` of an unmasked batch; ``(inputs, targets, {"scale": G / N})`` of a masked one
    ``(inputs, targets, norm)``: the shape of ``PipelineSpec.split_batch``'s result, ``loss_fn``'s keyword arguments
    last."""
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        return batch[0], batch[1], {"scale": loss_scale(batch[2])}
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"a batch of {type(batch).__name__} is not a token batch; give (inputs, targets) or (inputs, targets, norm)"
    )
