"""Step time and per-rank peak memory of the d_model 512 GPT per layout, activation checkpointing and compile.

Run by hand: ``.venv/bin/python benchmarks/memory_compute.py [--steps 8] [--warmup 3] [--layouts one,fsdp2,tp2,pp2]``.

Each case is a real run of the training app (``lightning_dist.app.fit`` on spawned gloo ranks, 1 thread per rank):
4 blocks of width 512, ``data.seq_len=128``, global batch 8, telemetry off. Per rank, a callback measures the mean
step time after ``--warmup`` steps (compilation happens in the first ones) and the growth of peak resident memory
from before the model is built to the end (model, gradients, optimizer state, activations, and for compile the
inductor's code and buffers). Each case runs twice: once for the step time (glibc's default allocator) and once for
the memory (a fixed 64 KiB mmap threshold, so peak RSS counts live tensors, not freed arena pages; this costs step
time). Reported as ratios to the plain eager one-process step: time (the slowest rank) and
memory (the largest rank).

Results: docs/benchmarks.md, "Activation checkpointing x compile x layout".
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LAYOUTS = {
    "one": ["parallelism=fsdp", "cluster.devices=1"],
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "pp2": ["parallelism=pp", "cluster.devices=2", "parallelism.pipeline.microbatches=4"],
}
AC = {
    "none": [],
    "op": ["parallelism.activation_checkpointing.mode=selective"],
    "full": ["parallelism.activation_checkpointing.mode=full"],
}
MODEL = [
    "model.d_model=512",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.max_seq_len=128",
    "data.seq_len=128",
    "data.global_batch_size=8",
    "data.num_train_samples=512",
    "logger=none",
    "telemetry.enabled=false",
    "trainer.enable_checkpointing=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
]


class _Probe(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def _fit(cfg, warmup: int, exact_memory: bool) -> dict:
    import ctypes

    from lightning_dist.run.fit import fit

    if exact_memory:  # RSS follows live tensors (see tests/distributed/test_meta_init.py), at a cost in step time
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)

    probe = _Probe(warmup)
    fit(cfg, callbacks=(probe,))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": sum(probe.times) / len(probe.times), "growth_mb": (peak - probe.before) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--d-model", type=int, default=512, help="width (the compile speedup of issue 11: 256)")
    parser.add_argument("--ac", default=",".join(AC), help="activation checkpointing modes to run")
    args = parser.parse_args()

    import tempfile

    from helpers import compose_config

    from lightning_dist.run.launch import launch

    rows, base = [], None
    model = [f"model.d_model={args.d_model}" if item.startswith("model.d_model=") else item for item in MODEL]
    for layout in args.layouts.split(","):
        for ac in args.ac.split(","):
            for compiled in (False, True):
                if compiled and layout.startswith("tp"):
                    print(f"{layout:6} {ac:5} compile=on  refused with tp > 1 on torch 2.13 (see compose.py)")
                    continue
                overrides = [*model, *LAYOUTS[layout], *AC[ac], f"trainer.max_steps={args.warmup + args.steps}"]
                overrides.append(f"parallelism.compile={str(compiled).lower()}")
                cfg = compose_config(overrides, tempfile.mkdtemp())
                ranks = launch(_fit, cfg.cluster.devices, cfg, args.warmup, False, threads_per_rank=1)
                step = max(rank["step_s"] for rank in ranks)
                ranks = launch(_fit, cfg.cluster.devices, cfg, args.warmup, True, threads_per_rank=1)
                memory = max(rank["growth_mb"] for rank in ranks)
                base = base or (step, memory)
                rows.append((layout, ac, "on" if compiled else "off", step, memory))
                print(
                    f"{layout:6} {ac:5} compile={'on ' if compiled else 'off'} step {step * 1e3:8.1f} ms "
                    f"({step / base[0]:.2f}x)  peak growth {memory:7.1f} MB ({memory / base[1]:.2f}x)",
                    flush=True,
                )
    print("\n| layout | AC | compile | step ms | time ratio | peak growth MB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for layout, ac, compiled, step, memory in rows:
        print(
            f"| {layout} | {ac} | {compiled} | {step * 1e3:.1f} | {step / base[0]:.2f} | {memory:.0f} | "
            f"{memory / base[1]:.2f} |"
        )


if __name__ == "__main__":
    main()
