"""How long a fault-tolerant run (``parallelism.replicas.recovery=torchft``) stalls when a replica group is lost, and
how long the lost group takes to train again.

Run by hand: ``.venv/bin/python benchmarks/replica_recovery.py [--steps 40] [--kill-at 8] [--heartbeat 2]``.

- The job: the default GPT, 2 replica groups x FSDP2 over 2 ranks each (4 CPU ranks, gloo), a checkpoint every step
  (each group publishes ``checkpoints/step-N`` as it finishes step N: the clock this script reads).
- ``--kill-at``: once group 1 has published that step, one of its ranks is SIGKILLed.
- Survivor's stall: the longest gap between group 0's published steps after the kill, against their median gap
  before it (what a step costs here). The Lighthouse drops the lost group after ``--heartbeat`` seconds.
- Rejoin: from the kill to the first step group 1 publishes again (its restart: start-up, the quorum, a healthy
  group's state copied over torchft), and the steps group 0 trained alone in between.

Results: docs/how-to/failures.md, "Losing a replica group without stopping".
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def published(checkpoints: Path) -> int | None:
    """The newest step a group has published (``checkpoints/latest``), or None."""
    try:
        return int((checkpoints / "latest").read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return None


def group_ranks(job: int, group: int) -> list[int]:
    """The rank processes of replica group ``group`` below ``job`` (``ps`` shows them as ``group<g>-rank<r>``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith(f"group{group}-rank"):
                continue
            ancestor = int(entry.name)
            while ancestor not in (0, 1, job):
                ancestor = int((Path("/proc") / str(ancestor) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == job:
            found.append(int(entry.name))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--heartbeat", type=float, default=2.0, help="parallelism.replicas.heartbeat_timeout_s")
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp(prefix="replica-recovery-")) / "run"
    command = [
        sys.executable,
        "-m",
        "lightning_dist.run.train",
        "logger=none",
        "parallelism=fsdp",
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=2",
        "cluster.devices=4",
        "parallelism.replicas.recovery=torchft",
        f"parallelism.replicas.heartbeat_timeout_s={args.heartbeat}",
        f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_checkpointing=true",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=2",
        "resilience.max_restarts=1",
        "data.global_batch_size=8",
        "data.seq_len=64",
        f"output_dir={run}",
    ]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[int, dict[int, float]] = {0: {}, 1: {}}  # group -> step -> when it was first seen published
    killed_at = None
    while job.poll() is None:
        now = time.monotonic()
        for group in (0, 1):
            step = published(run / f"replica-{group}" / "checkpoints")
            if step is not None and step not in seen[group]:
                seen[group][step] = now
        if killed_at is None and max(seen[1], default=0) >= args.kill_at:
            victims = group_ranks(job.pid, 1)
            os.kill(victims[-1], signal.SIGKILL)
            killed_at, kill_step = time.monotonic(), max(seen[1])
        time.sleep(0.02)
    if job.returncode != 0 or killed_at is None:
        sys.exit(f"the job failed (rc {job.returncode}): {job.stderr.read()[-2000:] if job.stderr else ''}")
    before = sorted(t for s, t in seen[0].items() if t < killed_at)
    after = sorted(t for t in seen[0].values() if t >= killed_at)
    step_s = statistics.median(b - a for a, b in itertools.pairwise(before))
    stall = max(b - a for a, b in itertools.pairwise([before[-1], *after]))
    back = min((t, s) for s, t in seen[1].items() if t > killed_at)
    alone = [s for s, t in seen[0].items() if killed_at <= t <= back[0]]
    print(f"killed a rank of group 1 after its step {kill_step}; heartbeat timeout {args.heartbeat} s")
    print(f"group 0: median step {step_s:.2f} s before the kill; longest gap after it {stall:.2f} s")
    print(f"group 1: trained again {back[0] - killed_at:.1f} s after the kill (its step {back[1]}); group 0 trained")
    print(f"  {len(alone)} steps alone in between; both ended at step {max(seen[0])} / {max(seen[1])}")


if __name__ == "__main__":
    main()
