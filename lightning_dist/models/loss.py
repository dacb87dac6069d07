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

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

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


def chunked_token_loss(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    targets: Tensor,
    chunks: int,
    scale: Tensor | None = None,
    logits_fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """:func:`token_loss` of ``logits_fn(head(hidden))`` without ever holding the whole ``(B, T, V)`` logits.

    The ``B x T`` tokens are cut into ``chunks`` pieces; each piece's logits and cross-entropy (summed, fp32) are
    computed under ``torch.utils.checkpoint``, which keeps only the piece's hidden states (views of ``hidden``, which
    the head keeps anyway) and recomputes its logits in the backward, one piece at a time. So the loss's peak holds
    one piece's logits, ``1 / chunks`` of the plain loss's (``lightning_dist/plan/memory.py``), for one more head matmul
    per token in the backward. The pieces' sums are added and normalized as :func:`token_loss` does (the mean over the
    targets that are not ``-100``, or ``sum * scale / B``): the same value up to the order of an fp32 sum.

    Args:
        hidden: The final (normalized) hidden states, ``(B, T, C)``; a sequence-sharded DTensor (tensor parallelism
            with sequence parallelism) is gathered once, as the head's own input hook would.
        head: The output head (a module or function of ``(N, C)`` to ``(N, V)``), applied to each piece; under
            tensor parallelism its vocabulary-sharded output goes into loss parallelism's cross-entropy.
        targets: ``(B, T)`` token ids, ``-100`` where no loss is taken.
        chunks: Pieces of the ``B x T`` tokens (>= 1; more pieces: less memory, the same number of FLOPs).
        scale: As in :func:`token_loss`: the step's ``G / N`` of masked data, else ``None``.
        logits_fn: Applied to each piece's logits before the loss (a model's logit scaling or soft-capping).
    """
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be >= 1 (pieces of the tokens the loss computes one at a time).")
    if isinstance(hidden, DTensor) and not all(p.is_replicate() for p in hidden.placements):
        # Each tp rank needs every token for its vocabulary columns: gather the sequence once, not once per piece.
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    flat, labels = hidden.flatten(0, 1), targets.flatten()  # (B*T, C), (B*T,)
    size = -(-labels.shape[0] // chunks)
    total = sum(
        checkpoint(_piece_loss, piece, piece_labels, head, logits_fn, use_reentrant=False, preserve_rng_state=False)
        for piece, piece_labels in zip(flat.split(size), labels.split(size))
    )
    if scale is None:
        return total / (labels != IGNORE_INDEX).sum()
    return total * (scale.reshape(-1)[0] / targets.shape[0])


def _piece_loss(
    hidden: Tensor, targets: Tensor, head: Callable[[Tensor], Tensor], logits_fn: Callable[[Tensor], Tensor] | None
) -> Tensor:
    """The summed fp32 cross-entropy of one piece of the tokens: ``hidden`` (N, C), ``targets`` (N,)."""
    logits = head(hidden)  # (N, V), or its vocabulary shard under tensor parallelism
    if logits_fn is not None:
        logits = logits_fn(logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
