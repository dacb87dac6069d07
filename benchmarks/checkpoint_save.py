"""Checkpoint save time and training-loop blocking time, synchronous vs asynchronous, against the disk's own write
bandwidth; and the restart time of the default job after a rank is killed.

Run by hand: ``.venv/bin/python benchmarks/checkpoint_save.py [--dir /tmp/ckpt-bench] [--saves 3]``.

- Disk: ``dd if=/dev/zero of=<dir>/dd bs=1M count=1024 conv=fdatasync`` (1 GiB, flushed), its MB/s.
- Saves: a run of the training app (fsdp2, 2 CPU ranks) on a GPT whose checkpoint is ~1 GiB (parameters and both
  AdamW moments in fp32: 12 bytes per parameter), saving every 2 steps; per save, ``blocked`` = how long the training
  loop waited (the whole save when synchronous; the copy to host memory when asynchronous) and ``written`` = until
  the files were complete (DCP fsyncs each file). Bytes = the published folder's size.
- Restart: the default job (``lightning-dist-train``, 2 ranks, checkpoint every step, ``max_restarts=1``); one rank
  is killed (SIGKILL) after the first checkpoint; time from the kill to the next checkpoint the restarted job
  publishes (one step after the restart: detection, new processes, imports, loading, one step, one save).

Results: docs/benchmarks.md, "Checkpoint save and restart".
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = ["model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.vocab_size=256", "model.max_seq_len=64"]
RUN = ["parallelism=fsdp", "cluster.devices=2", "logger=none", "trainer.limit_val_batches=0",
       "trainer.num_sanity_val_steps=0", "telemetry.enabled=false", "data.global_batch_size=2", "data.seq_len=64",
       "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=2", "checkpoint.keep_last=1"]  # fmt: skip


def disk_bandwidth(folder: Path) -> float:
    """MB/s of a 1 GiB ``dd`` write flushed with fdatasync."""
    target = folder / "dd"
    out = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=1024", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    target.unlink()
    seconds = float(re.search(r"([\d.]+) s,", out).group(1))
    return 1024 * 2**20 / seconds / 1e6


def saves(folder: Path, num_saves: int, asynchronous: bool) -> dict:
    from helpers import run_app

    overrides = [*RUN, *MODEL, f"trainer.max_steps={2 * num_saves}", f"checkpoint.async_save={asynchronous}"]
    result = run_app(overrides, folder)
    size = sum(f.stat().st_size for f in Path(result["checkpoint"]).rglob("*") if f.is_file())
    return {"blocked": result["checkpoint_blocked_s"], "written": result["checkpoint_written_s"], "bytes": size}


def restart_time(folder: Path) -> float:
    """Seconds from SIGKILL of a rank to the restarted job's first published checkpoint."""
    from lightning_dist.checkpoint.store import latest_checkpoint

    command = [sys.executable, "-m", "lightning_dist.run.train", "logger=none", "trainer.max_steps=300",
               "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=1", "resilience.max_restarts=1",
               f"output_dir={folder}"]  # fmt: skip
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while latest_checkpoint(folder / "checkpoints") is None:
        time.sleep(0.05)
    time.sleep(1.0)
    ranks = [int(c) for child in _children(job.pid) for c in _children(child)]
    os.kill(max(ranks), signal.SIGKILL)
    killed, restarts = time.monotonic(), folder / "restarts.log"
    while not restarts.exists():
        time.sleep(0.01)
    resumed_from = int(re.search(r"step-(\d+)", restarts.read_text()).group(1))
    restarted_wall = time.time()
    pointer = folder / "checkpoints" / "latest"
    while True:  # a checkpoint past the resumed step, published by the restarted job
        latest = latest_checkpoint(folder / "checkpoints")
        step = int(latest.name.removeprefix("step-")) if latest is not None else -1
        if step > resumed_from and pointer.stat().st_mtime > restarted_wall:
            break
        time.sleep(0.01)
    elapsed = time.monotonic() - killed
    job.terminate()
    job.wait()
    return elapsed


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 2) for value in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckpt-bench"))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--restart-only", action="store_true", help="only the restart time")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"dd (1 GiB, fdatasync): {disk_bandwidth(args.dir):.0f} MB/s")
    for asynchronous in () if args.restart_only else (False, True):
        found = saves(args.dir / f"async-{asynchronous}", args.saves, asynchronous)
        gib = found["bytes"] / 2**30
        blocked, written = statistics.median(found["blocked"]), statistics.median(found["written"])
        print(
            f"{'async' if asynchronous else 'sync ':5s}: checkpoint {gib:.2f} GiB, training blocked {blocked:.2f} s, "
            f"written in {written:.2f} s ({found['bytes'] / written / 1e6:.0f} MB/s) "
            f"[per save: blocked {_rounded(found['blocked'])}, written {_rounded(found['written'])}]"
        )
    times = [restart_time(args.dir / f"restart-{i}") for i in range(3)]
    print(f"restart (kill -> first checkpoint after restart, default job): {_rounded(times)} s")


if __name__ == "__main__":
    main()
