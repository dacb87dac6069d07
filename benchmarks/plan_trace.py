"""The traced check at full size: one rank of Llama 3 70B on 256 H100s (tp8 x dp_shard32, 8 micro batches, full
activation checkpointing, bf16-mixed), stepped on fake tensors over torch's fake backend, next to the planner.

Run by hand: ``.venv/bin/python benchmarks/plan_trace.py [--memory]`` (about 90 s here; ``--memory`` also follows
the step with torch's MemTracker, much slower). It prints the traced and analytic parameters, gradient and AdamW
bytes and the collectives per axis of one optimizer step (the training loop's scalars left out of both).

Results: docs/planner.md (`plan.trace=true`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

OVERRIDES = ["model=llama_70b", "cluster=slurm", "cluster.num_nodes=32", "data.seq_len=8192",
             "data.global_batch_size=256", "logger=none"]  # fmt: skip


def main() -> None:
    from helpers import compose_config

    from lightning_dist.plan.cli import apply_layout
    from lightning_dist.plan.collectives import per_axis, step_collectives
    from lightning_dist.plan.cost import estimate
    from lightning_dist.plan.layout import Layout
    from lightning_dist.plan.trace import trace_rank

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="also trace the step's peak memory (MemTracker)")
    args = parser.parse_args()
    cfg = compose_config(OVERRIDES)
    layout = Layout.of(1, 8, dp_shard=32, tp=8, activation_checkpointing={"mode": "full"})
    start = time.perf_counter()
    traced = trace_rank(apply_layout(cfg, layout), 0, step=True, memory=args.memory)
    seconds = time.perf_counter() - start
    planned = estimate(cfg.model, layout, cfg.hardware, 8192, 256).memory
    comm = per_axis(step_collectives(cfg.model, layout, 8192, "bf16-mixed", stage=0, loop=False))
    print(f"{layout.describe()} on 256 ranks, rank 0 traced in {seconds:.0f} s")
    rows = [("parameter bytes", traced.param_bytes, planned.params), ("gradient bytes", traced.grad_bytes,
            planned.grads), ("AdamW bytes", traced.optimizer_bytes, planned.optimizer)]  # fmt: skip
    if args.memory:
        rows.append(("peak bytes (no margin)", traced.peak_bytes, int(planned.total / (1 + planned.margin))))
    for name, got, want in rows:
        print(f"  {name}: traced {got:,}, planned {want:,} ({(got - want) / want:+.3%})")
    for axis in sorted(set(comm) | set(traced.collectives or {})):
        got, want = (traced.collectives or {}).get(axis, {}), comm.get(axis, {})
        print(f"  comm/{axis}: traced {got.get('bytes', 0):,} B in {got.get('calls', 0)} calls, "
              f"planned {want.get('bytes', 0):,} B in {want.get('calls', 0)} calls")  # fmt: skip


if __name__ == "__main__":
    main()
