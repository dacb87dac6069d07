"""SIGTERM to the job's main process: every rank stops at the same step boundary, saves, and the job exits with
code 75; no process or temporary folder outlives it, and ``resume=<run folder>`` gives the uninterrupted curve."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from helpers import FAST, losses, run_app

from lightning_dist.checkpoint import latest_checkpoint
from lightning_dist.launch import PREEMPTED_EXIT_CODE

STEPS = 40
RUN = [*FAST, "parallelism=fsdp", f"trainer.max_steps={STEPS}", "logger=csv", "optim.warmup_steps=5"]
SAVING = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc: children of each of its threads)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_sigterm_to_the_main_process_saves_stops_and_resumes_exactly(tmp_path: Path) -> None:
    whole = run_app(RUN, tmp_path / "whole")
    run_dir = tmp_path / "run"
    temporary = set(Path(tempfile.gettempdir()).glob("lightning-dist-*"))
    command = [sys.executable, "-m", "lightning_dist.train", *RUN, *SAVING, f"output_dir={run_dir}"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while latest_checkpoint(run_dir / "checkpoints") is None:  # training has started (step 1 is published)
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.2)
    ranks = _descendants(job.pid)
    os.kill(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr[-2000:]
    assert "preempted: SIGTERM received; stopped after step" in stderr
    stopped = latest_checkpoint(run_dir / "checkpoints")
    assert 0 < int(stopped.name.removeprefix("step-")) < STEPS
    time.sleep(2)  # the forkserver notices its parent is gone within a moment
    assert not [pid for pid in ranks if _alive(pid)], "a process outlived the job"
    assert set(Path(tempfile.gettempdir()).glob("lightning-dist-*")) == temporary  # the launcher's folder is gone

    resumed = run_app([*RUN, *SAVING, f"resume={run_dir}"], tmp_path / "unused")
    assert resumed["steps"] == STEPS
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    np.testing.assert_allclose([float(row["train/loss"]) for row in rows], losses(whole), rtol=1e-6)
