"""Activation memory per rank under context parallelism: cp2 against cp1 for the same sequence, measured and planned.

Run by hand: ``.venv/bin/python benchmarks/cp_memory.py [--seq 256,1024,4096]``.

Each case is two gloo ranks on CPU, bf16-mixed, one sample per forward, FSDP2 over both ranks in both layouts (cp1:
``dp_shard=2``, each rank its own sample; cp2: ``cp=2``, one sample split). A rank builds the model through the
strategy's own parallelize path and runs the loss's forward under saved-tensor hooks
(:func:`lightning_dist.plan.measure.measure_activations`): the bytes autograd keeps for the backward, parameters
left out. Beside it, the planner's activations + logits (:func:`lightning_dist.plan.memory.estimate_memory`). The
model has Llama 3 8B's proportions at a tiny width (:data:`SHAPE`: 4 query heads per key / value head, MLP 3.5 x
d_model, vocabulary 32 x d_model).

Results: docs/planner.md, "Context parallelism".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

#: Llama 3 8B's proportions (32 / 8 heads, 14336 / 4096 MLP, 128256 / 4096 vocabulary) at d_model 128, 4 blocks.
SHAPE = ["model.d_model=128", "model.n_heads=4", "model.n_kv_heads=1", "model.ffn_hidden=448", "model.vocab_size=4096",
         "data.vocab_size=4096", "model.n_layers=4"]  # fmt: skip
LAYOUTS = {"cp1": ["parallelism.dp_shard=2"], "cp2": ["parallelism.cp=2", "parallelism.dp_shard=1"]}


def overrides(seq: int, layout: str) -> list[str]:
    """The app's overrides of one case: ``layout`` (``cp1`` / ``cp2``) at ``seq`` tokens."""
    from helpers import FAST

    run = ["parallelism=fsdp", "cluster.devices=2", f"data.seq_len={seq}", f"model.max_seq_len={seq}",
           "data.global_batch_size=2", "data.micro_batch_size=1", "cluster.precision=bf16-mixed"]  # fmt: skip
    return [*FAST, *SHAPE, *run, *LAYOUTS[layout]]


def planned(cfg) -> int:
    """The planner's bytes kept for the backward by one rank: its activations, and of the loss head the fp32
    log-softmax (4 bytes per logit; the planner's ``LOGIT_BYTES`` also counts the bf16 logits and their fp32 copy,
    alive at the loss's peak but not kept for the backward, which saved-tensor hooks do not see)."""
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.memory import LOGIT_BYTES, estimate_memory

    found = estimate_memory(cfg.model, build_parallel_dims(cfg), cfg.parallelism, local_params=0,
                            seq_len=cfg.data.seq_len, micro_batch=cfg.data.micro_batch_size)  # fmt: skip
    return found.activations + found.logits * 4 // LOGIT_BYTES


def case(seq: int) -> dict[str, dict[str, int]]:
    """``{layout: {"measured", "planned"}}`` at ``seq`` tokens (rank 0; every rank measures the same)."""
    from helpers import compose_config

    from lightning_dist.plan.measure import measure_activations
    from lightning_dist.run.launch import launch

    out = {}
    for layout in LAYOUTS:
        cfg = compose_config(overrides(seq, layout))
        ranks = launch(measure_activations, 2, cfg)
        out[layout] = {"measured": ranks[0]["saved_bytes"], "planned": planned(cfg)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024,4096", help="comma-separated sequence lengths")
    args = parser.parse_args()
    print("| seq | cp1 measured | cp2 measured | cp2 / cp1 measured | cp2 / cp1 planned | planned / measured "
          "(cp1, cp2) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq.split(",")):
        start = time.perf_counter()
        found = case(seq)
        one, two = found["cp1"], found["cp2"]
        print(f"| {seq} | {one['measured'] / 2**20:.2f} MiB | {two['measured'] / 2**20:.2f} MiB | "
              f"{two['measured'] / one['measured']:.3f} | {two['planned'] / one['planned']:.3f} | "
              f"{one['planned'] / one['measured']:.3f}, {two['planned'] / two['measured']:.3f} |",
              flush=True)  # fmt: skip
        print(f"<!-- seq {seq}: {time.perf_counter() - start:.0f} s -->", file=sys.stderr)


if __name__ == "__main__":
    main()
