"""How far a float8 run's loss curve is from the high-precision one: the built-in GPT on the synthetic Markov data,
one process on the CPU (torchao's emulated float8, the numbers a float8 GPU computes up to its matmul rounding).

``python benchmarks/float8_curve.py [--steps 300] [--d-model 64]``: the largest relative difference of the loss,
step by step and of a 20-step moving average, between fp32 and float8 tensorwise / rowwise (same seed, same
batches). ``tests/unit/test_float8_conversion.py`` holds the curve within ``FLOAT8_LOSS_RTOL``
(``lightning_dist/parallel/float8.py``), which comes from this measurement.
"""

from __future__ import annotations

import argparse

import torch

from lightning_dist.data.synthetic import MarkovChain, SyntheticDataset
from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.loss import token_loss
from lightning_dist.parallel.float8 import apply_float8


def curve(recipe: str, steps: int, d_model: int, batch: int = 8, seq: int = 32, vocab: int = 256) -> list[float]:
    """Per-step training losses of a 2-block GPT, AdamW 3e-3, float8 ``recipe`` (``off``: fp32)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, n_layers=2, d_model=d_model, n_heads=4, n_kv_heads=2,
                          ffn_hidden=2 * d_model, max_seq_len=seq))  # fmt: skip
    if recipe != "off":
        apply_float8(list(model.layers.values()), recipe, "cpu", fsdp=False)
    data = SyntheticDataset(MarkovChain(vocab, 4, seed=0), steps * batch, seq, "train", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        rows = data.tokens[step * batch : (step + 1) * batch]
        inputs, targets = rows[:, :-1], rows[:, 1:]
        loss = token_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare(reference: list[float], other: list[float], window: int = 20) -> dict[str, float]:
    """The largest relative difference per step and of the ``window``-step moving averages."""
    step = max(abs(a - b) / abs(a) for a, b in zip(reference, other))
    avg = [sum(reference[i : i + window]) / window for i in range(len(reference) - window + 1)]
    avg_other = [sum(other[i : i + window]) / window for i in range(len(other) - window + 1)]
    return {"step": step, "moving_average": max(abs(a - b) / abs(a) for a, b in zip(avg, avg_other))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: OpenMP threads only wait on each other (and on a shared machine, spin)
    reference = curve("off", args.steps, args.d_model)
    print(f"fp32: first {reference[0]:.4f}, last {reference[-1]:.4f}")
    for recipe in ("tensorwise", "rowwise"):
        losses = curve(recipe, args.steps, args.d_model)
        diff = compare(reference, losses)
        print(f"{recipe}: last {losses[-1]:.4f}; largest relative difference per step {diff['step']:.4f}, "
              f"20-step average {diff['moving_average']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
