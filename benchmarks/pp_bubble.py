"""Measured pipeline bubble (idle fraction) per schedule, next to the theory, for p=2 stages on CPU (gloo).

Run by hand: ``.venv/bin/python benchmarks/pp_bubble.py``. Each rank times the work its stages do (forward and
backward chunks of ``PipelineStage``) during a step; the bubble is ``1 - busy / step time``, averaged over ranks.
Theory for GPipe / 1F1B: ``(p - 1) / (m + p - 1)``; interleaving with v stages per rank divides the warmup and
cooldown by v: ``(p - 1) / (v * m + p - 1)``. Blocks are wide MLPs so compute dominates the point-to-point sends.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_dist.launch import free_port
from lightning_dist.parallel.pipeline import build_schedule, stage_ids

P = 2
WIDTH, BATCH_PER_MICROBATCH, BLOCKS = 512, 32, 8
CASES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)]


def _blocks(keys: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in keys])


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    busy = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(PipelineStage, name)

        def timed(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(PipelineStage, name, timed)
    for schedule_name, per_rank in CASES:
        for m in (2, 4, 8):
            num_stages = P * per_rank
            per_stage = BLOCKS // num_stages
            stages = [
                PipelineStage(_blocks(list(range(per_stage))), sid, num_stages, torch.device("cpu"))
                for sid in stage_ids(rank, P, per_rank, schedule_name)
            ]
            schedule = build_schedule(schedule_name, stages, m, lambda out, target: out.square().mean())
            x = torch.randn(m * BATCH_PER_MICROBATCH, WIDTH)
            fractions = []
            for step in range(4):
                dist.barrier()
                busy[0] = 0.0
                start = time.perf_counter()
                schedule.step(x, target=x)
                wall = time.perf_counter() - start
                if step > 0:  # the first step infers shapes
                    fractions.append(1 - busy[0] / wall)
            measured = torch.tensor(sum(fractions) / len(fractions))
            dist.all_reduce(measured)
            if rank == 0:
                results[(schedule_name, m)] = float(measured) / P
    dist.destroy_process_group()


def main() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(free_port(), results), nprocs=P)
        print(f"p={P} stages, {BLOCKS} blocks of {WIDTH}x{WIDTH}, {BATCH_PER_MICROBATCH} rows per microbatch")
        print(f"{'schedule':<16} {'v':>2} {'m':>3} {'measured bubble':>16} {'theory':>8}")
        for schedule_name, per_rank in CASES:
            for m in (2, 4, 8):
                theory = (P - 1) / (per_rank * m + P - 1)
                print(f"{schedule_name:<16} {per_rank:>2} {m:>3} {results[(schedule_name, m)]:>16.3f} {theory:>8.3f}")


if __name__ == "__main__":
    main()
