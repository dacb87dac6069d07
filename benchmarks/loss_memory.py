"""The chunked loss's memory on the CPU: the peak of live tensors of one forward and backward (bf16 autocast, the
mixed-precision step) of a GPT with a 32K vocabulary, for ``loss_chunks`` 0 (the plain loss) to 16, against the
planner's logits term (``plan/memory.py``). ``python benchmarks/loss_memory.py``: a markdown table (docs/benchmarks.md).

The vocabulary-dependent peak is the peak at V less the peak at V / 2, doubled (the embedding and head frozen, so no
vocabulary-sized gradient; autocast's bf16 copy of the head taken off: 2 bytes per weight). Kept for the backward:
saved-tensor hooks at the end of the forward.
"""

from __future__ import annotations

import torch

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.loss import chunked_token_loss, token_loss
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.measure import PeakBytes, SavedBytes
from lightning_dist.plan.memory import estimate_memory

SEQ, BATCH, VOCAB, WIDTH = 1024, 2, 32768, 256
MIB = 2**20


def config(vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, n_layers=2, d_model=WIDTH, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)


def step(vocab: int, chunks: int) -> tuple[int, int]:
    """(peak bytes, bytes kept for the backward) of one forward and backward."""
    torch.manual_seed(0)
    model = GPT(config(vocab))
    model.head.weight.requires_grad_(False)
    model.tok_emb.weight.requires_grad_(False)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with PeakBytes() as peak, torch.autocast("cpu", dtype=torch.bfloat16):
        with SavedBytes() as saved:
            if chunks:
                loss = chunked_token_loss(model(tokens[:, :-1], logits=False), model.head, tokens[:, 1:], chunks)
            else:
                loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return peak.peak, saved.bytes


def main() -> None:
    torch.set_num_threads(1)
    rows = ["| loss_chunks | step peak MiB | vocabulary-dependent peak MiB | planned logits MiB | measured / planned "
            "| kept for backward MiB |", "|---|---|---|---|---|---|"]  # fmt: skip
    for chunks in (0, 2, 4, 8, 16):
        (whole, saved), (half, _) = step(VOCAB, chunks), step(VOCAB // 2, chunks)
        copy = VOCAB // 2 * WIDTH * 2 * 2  # autocast's bf16 head copy grows by V/2 rows; doubled with the rest
        measured = 2 * (whole - half) - copy
        planned = estimate_memory(config(VOCAB), ParallelDims(1), Parallelism(loss_chunks=chunks), local_params=0,
                                  seq_len=SEQ, micro_batch=BATCH).logits  # fmt: skip
        rows.append(f"| {chunks} | {whole / MIB:,.1f} | {measured / MIB:,.1f} | {planned / MIB:,.1f} | "
                    f"{measured / planned:.2f} | {saved / MIB:,.1f} |")  # fmt: skip
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
