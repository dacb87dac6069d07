"""The chunked loss's memory, measured: the part of a step's peak that grows with the vocabulary (the logits and
what the loss keeps of them) falls to ``1 / n`` with ``loss_chunks=n``, as the planner's logits term does
(``plan/memory.py``); its bytes kept for the backward lose the logits entirely. Real tensors on the CPU, bf16
autocast (the mixed-precision step), the peak of live tensors (``plan/measure.py: PeakBytes``)."""

from __future__ import annotations

import pytest
import torch

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.loss import chunked_token_loss, token_loss
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.measure import PeakBytes, SavedBytes
from lightning_dist.plan.memory import estimate_memory

SEQ, BATCH, SMALL, LARGE = 128, 2, 1024, 2048
TOKENS = SEQ * BATCH


def _config(vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=SEQ)


def _step(vocab: int, chunks: int) -> tuple[int, int]:
    """(peak bytes of a forward and backward, bytes kept for the backward) of a 1-block GPT, the embedding and head
    frozen (no vocabulary-sized gradients: only the logits grow with the vocabulary)."""
    torch.manual_seed(0)
    model = GPT(_config(vocab))
    model.head.weight.requires_grad_(False)
    model.tok_emb.weight.requires_grad_(False)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with PeakBytes() as peak, torch.autocast("cpu", dtype=torch.bfloat16):
        with SavedBytes() as saved:
            if chunks:
                loss = chunked_token_loss(model(inputs, logits=False), model.head, targets, chunks)
            else:
                loss = token_loss(model(inputs), targets)
        loss.backward()
    return peak.peak, saved.bytes


@pytest.fixture(scope="module")
def measured() -> dict[int, dict[str, float]]:
    """Per chunk count: the peak's and the kept bytes' growth per logit from the small to the large vocabulary, less
    autocast's bf16 copy of the head's growth (2 bytes per weight, not a logit)."""
    logits = TOKENS * (LARGE - SMALL)
    copy = (LARGE - SMALL) * 64 * 2
    out = {}
    for chunks in (0, 4, 8):
        (small_peak, small_saved), (large_peak, large_saved) = _step(SMALL, chunks), _step(LARGE, chunks)
        kept = large_saved - small_saved - (copy if not chunks else 0)  # the plain head's matmul keeps the copy too
        out[chunks] = {"peak": (large_peak - small_peak - copy) / logits, "saved": kept / logits}
    return out


@pytest.mark.parametrize("chunks", [4, 8])
def test_the_chunked_loss_peak_is_the_planned_share_of_the_plain_one(chunks: int, measured) -> None:
    def planned(vocab: int, n: int) -> int:
        options = Parallelism(loss_chunks=n)
        return estimate_memory(_config(vocab), ParallelDims(1), options, local_params=0, seq_len=SEQ,
                               micro_batch=BATCH).logits  # fmt: skip

    planned_share = (planned(LARGE, chunks) - planned(SMALL, chunks)) / (planned(LARGE, 0) - planned(SMALL, 0))
    assert planned_share == pytest.approx(1 / chunks, rel=0.01)
    assert measured[chunks]["peak"] / measured[0]["peak"] == pytest.approx(planned_share, rel=0.1)
    # The plain loss keeps its fp32 log-softmax for the backward (4 bytes per logit); the chunked one keeps none.
    assert measured[0]["saved"] == pytest.approx(4, rel=0.01) and measured[chunks]["saved"] == 0
