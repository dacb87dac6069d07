"""SIGTERM to the job's main process: every rank stops at the same step boundary, saves, and the job exits with
code 75; no process or temporary folder outlives it, and ``resume=<run folder>`` gives the uninterrupted curve."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, fresh_env, losses, run_app

from lightning_dist.callbacks.preemption import PREEMPTED_EXIT_CODE
from lightning_dist.checkpoint.store import latest_checkpoint

STEPS = 24
RUN = [*FAST, "parallelism=fsdp", f"trainer.max_steps={STEPS}", "logger=csv", "optim.warmup_steps=5"]
SAVING = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc: children of each of its threads)."""
    found, todo = set(), [pid]
    while todo:
        children = _children(todo.pop())
        todo.extend(children - found)
        found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run."""
    return run_app(RUN, tmp_path_factory.mktemp("whole"))


def test_sigterm_to_the_main_process_saves_stops_and_resumes_exactly(
    whole: dict, tmp_path: Path, own_tmp: Path
) -> None:
    run_dir, temporary = tmp_path / "run", own_tmp
    command = [sys.executable, "-m", "lightning_dist.run.train", *RUN, *SAVING, f"output_dir={run_dir}"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           cwd=tmp_path,
                           env={**os.environ, "TMPDIR": str(temporary)})  # fmt: skip
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
    assert not list(temporary.iterdir())  # the launcher's folder is gone

    resumed = run_app([*RUN, *SAVING, f"resume={run_dir}"], tmp_path / "unused")
    assert resumed["steps"] == STEPS
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    np.testing.assert_allclose([float(row["train/loss"]) for row in rows], losses(whole), rtol=1e-6)


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A temporary-files folder for one job (its TMPDIR), so its launcher's folder is found among no one else's.

    Short and under /tmp: the forkserver's socket lives there, and a UNIX socket path has at most 107 characters.
    """
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _ranks(pid: int) -> list[int]:
    """The job's ranks: the forkserver's children, i.e. the main process's grandchildren."""
    return sorted(rank for child in _children(pid) for rank in _children(child))


def test_a_rank_killed_while_saving_restarts_from_the_previous_checkpoint(whole: dict, tmp_path: Path) -> None:
    """SIGKILL to a rank while DCP writes a checkpoint (its shard files appear, its ``.metadata`` not yet): that
    checkpoint is never published, and ``max_restarts=1`` continues from the one before with the uninterrupted curve."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    command = [sys.executable, "-m", "lightning_dist.run.train", *RUN, *SAVING, "resilience.max_restarts=1"]
    job = subprocess.Popen(
        [*command, f"output_dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    deadline = time.monotonic() + 240
    while latest_checkpoint(checkpoints) is None:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.05)
    victim = _ranks(job.pid)[-1]
    while True:  # the next save's shard files appear
        assert job.poll() is None and time.monotonic() < deadline, "no save was caught midway"
        writing = [p for p in checkpoints.glob(".step-*.partial") if any(p.glob("*.distcp"))]
        if writing and not (writing[0] / ".metadata").exists():
            os.kill(victim, signal.SIGKILL)
            break
        time.sleep(0.001)
    killed_step = int(writing[0].name.split("-")[1].split(".")[0])
    _, stderr = job.communicate(timeout=240)
    assert job.returncode == 0, stderr[-2000:]
    assert "restart 1/1: rank" in stderr and "was killed by signal SIGKILL" in stderr, stderr[-2000:]
    resumed_from = int(re.search(r"restart 1/1: .*; from .*step-(\d+)", stderr).group(1))
    assert resumed_from < killed_step, (resumed_from, killed_step)  # the interrupted save was not published
    assert "restart 1/1" in (run_dir / "restarts.log").read_text()
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    np.testing.assert_allclose([float(row["train/loss"]) for row in rows], losses(whole), rtol=1e-6)


def test_a_frozen_rank_ends_the_job_within_the_hang_timeout(tmp_path: Path, own_tmp: Path) -> None:
    from lightning_dist.callbacks import heartbeat

    temporary = own_tmp
    overrides = [*RUN, "trainer.max_steps=100000", "resilience.hang_timeout_s=3", f"output_dir={tmp_path}"]
    job = subprocess.Popen(
        [sys.executable, "-m", "lightning_dist.run.train", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temporary)},
        cwd=tmp_path,  # Hydra's own folder for the job goes there, not into the repository's outputs/
    )
    deadline, beats = time.monotonic() + 240, []
    while not any((beat := heartbeat.read(path)) is not None and beat[0] >= 3 for path in beats):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.2)
        beats = list(temporary.glob("lightning-dist-*/*.beat"))
    victim = _ranks(job.pid)[0]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        os.kill(victim, signal.SIGKILL) if _alive(victim) else None
    assert job.returncode == 1, stderr[-2000:]
    assert re.search(r"^error: rank \d: hung: no progress for \d+ s after step \d+ \(allowed 3 s", stderr, re.M), stderr
    # The bound: the allowance, the launcher's 1 s poll, and the time to notice and stop (generous for a busy CI).
    assert time.monotonic() - stopped_at < 3 + 30


def test_a_frozen_rank_under_torchrun_ends_the_job_within_the_hang_timeout(tmp_path: Path) -> None:
    """No launcher of ours: the ranks beat into the run folder and local rank 0's watchdog names a silent rank and
    kills the silent ones on its node; torchrun's agent then stops the rest (lightning_dist/run/watchdog.py)."""
    from lightning_dist.callbacks import heartbeat

    torchrun = str(Path(sys.executable).parent / "torchrun")
    overrides = [*RUN, "trainer.max_steps=100000", "resilience.hang_timeout_s=3", f"output_dir={tmp_path / 'run'}"]
    job = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node=2", "-m", "lightning_dist.run.train", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=fresh_env(),
    )  # fmt: skip
    beats = tmp_path / "run" / "heartbeats" / "attempt-0"
    deadline = time.monotonic() + 240
    while not all((beat := heartbeat.read(beats / f"{rank}.beat")) is not None and beat[0] >= 3 for rank in (0, 1)):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.2)
    workers = _children(job.pid)  # torchrun's agent starts the ranks as its children
    (victim,) = [pid for pid in workers if b"LOCAL_RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=180)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL) if _alive(pid) else None
    assert job.returncode != 0, stderr[-2000:]
    # The frozen rank 1, or rank 0 stalled in a collective with it (beats are written at most once a second).
    assert re.search(r"^error: rank \d: hung: no progress for \d+ s after step \d+ \(allowed 3 s", stderr, re.M), stderr
    # The bound: the allowance, 1 s polls, the watchdog killing the frozen rank (generous for a busy CI).
    assert time.monotonic() - stopped_at < 3 + 30
    assert not [pid for pid in workers if _alive(pid)]


@pytest.mark.slow  # the mechanism: tests/distributed/test_launch.py::test_a_rank_ends_when_its_launcher_is_gone
def test_sigkill_to_the_main_process_leaves_no_rank_behind(tmp_path: Path) -> None:
    """The main process cannot forward SIGKILL: each rank notices its launcher is gone (checked every second)."""
    overrides = [*RUN, "trainer.max_steps=100000", f"output_dir={tmp_path}", "trainer.enable_checkpointing=false"]
    job = subprocess.Popen(
        [sys.executable, "-m", "lightning_dist.run.train", *overrides], stderr=subprocess.DEVNULL, cwd=tmp_path
    )
    deadline = time.monotonic() + 240
    while len(ranks := _ranks(job.pid)) < 2 or not (tmp_path / "csv" / "metrics.csv").exists():  # training
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    everything = _descendants(job.pid)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    killed = time.monotonic()
    while [pid for pid in everything if _alive(pid)] and time.monotonic() - killed < 30:
        time.sleep(0.2)
    assert not [pid for pid in everything if _alive(pid)], f"ranks {ranks} outlived their launcher by 30 s"


@pytest.mark.slow  # the mechanisms: tests/unit/test_cluster.py (restart count, prefixed store)
def test_torchrun_max_restarts_continues_from_the_newest_checkpoint(whole: dict, tmp_path: Path) -> None:
    """Under torchrun the app does not restart itself: torchrun's ``--max-restarts`` does, and the restarted ranks
    find the job's one run folder (named by the rendezvous id) and continue from its newest checkpoint."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m", "lightning_dist.run.train"]
    job = subprocess.Popen([*command, *RUN, *SAVING], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("outputs/torchrun-*/checkpoints/latest")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
        time.sleep(0.2)
    os.kill(sorted(_children(job.pid))[-1], signal.SIGKILL)
    _, stderr = job.communicate(timeout=240)
    assert job.returncode == 0, stderr[-2000:]
    assert re.search(r"restart 1: continuing from .*step-\d+", stderr), stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()  # one folder for both ranks and both starts
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    np.testing.assert_allclose([float(row["train/loss"]) for row in rows], losses(whole), rtol=1e-6)
