"""One job per run folder: the lock the running job holds, released on every way out, and left by a crash in a way
the next job sees (and takes over)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, compose_config

from lightning_dist.run.lock import LOCK, hold_run_folder

HOLD = """
import sys, time
from lightning_dist.run.lock import hold_run_folder
with hold_run_folder(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding ``tmp_path``'s lock; killed (SIGKILL) at the end if still alive."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def test_a_second_run_on_a_folder_in_use_is_refused_before_launch(tmp_path: Path, holder: subprocess.Popen) -> None:
    from lightning_dist.run.train import run

    message = rf"output_dir={tmp_path} is in use by another run \(pid {holder.pid} on {socket.gethostname()}, started"
    with pytest.raises(ValueError, match=message + r".*\); wait for it to end, or start this run in a new folder"):
        run(compose_config([*FAST, "cluster.devices=1"], tmp_path))
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid  # the holder's record is left alone


def test_a_killed_holder_leaves_the_folder_free_and_says_so(
    tmp_path: Path, holder: subprocess.Popen, capfd: pytest.CaptureFixture
) -> None:
    holder.send_signal(signal.SIGKILL)  # no handler runs: the kernel drops its lock, its record stays
    holder.wait()
    with hold_run_folder(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert f"was left locked by pid {holder.pid} on {socket.gethostname()}" in capfd.readouterr().err
    assert (tmp_path / LOCK).read_text() == ""  # released: an empty record


def test_the_lock_is_released_however_the_run_ends(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    for ending in (ValueError("a bad value"), KeyboardInterrupt(), SystemExit(75)):
        with pytest.raises(type(ending)), hold_run_folder(tmp_path):
            raise ending
        fd = os.open(tmp_path / LOCK, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises BlockingIOError if still held
        os.close(fd)
        assert (tmp_path / LOCK).read_text() == ""
    assert "left locked" not in capfd.readouterr().err


def test_without_flock_the_record_decides(
    tmp_path: Path, holder: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some Lustre and NFS mounts have no flock: a live holder on this host (same pid and start time) still holds."""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(ValueError, match=rf"is in use by another run \(pid {holder.pid} on"), hold_run_folder(tmp_path):
        pass
    holder.kill()
    holder.wait()
    with hold_run_folder(tmp_path):  # the pid is gone: taken over
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()


def test_removing_the_lock_file_never_frees_the_folder_of_a_live_run(tmp_path: Path, holder: subprocess.Popen) -> None:
    """The probe: the refusal said "If that run is gone, remove .run.lock"; done while the holder lived, a second run
    took the folder and wrote over the first's. The lock is on the folder now, and the refusal names the holder from
    the kernel's own table, saying it is running and that removing the file would not stop it."""
    (tmp_path / LOCK).unlink()
    with pytest.raises(ValueError) as refused, hold_run_folder(tmp_path):
        pass
    assert str(refused.value) == (
        f"output_dir={tmp_path} is in use by another run (pid {holder.pid}, its {LOCK} record removed); wait for it to "
        f"end, or start this run in a new folder (output_dir=...). It is running: stop it first (kill {holder.pid} on "
        f"{socket.gethostname()}) if it must go; removing {LOCK} would not stop it."
    )
    holder.kill()
    holder.wait()
    with hold_run_folder(tmp_path):  # gone: the folder is free
        pass


def test_only_a_holder_this_host_cannot_check_comes_with_a_removal_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No flock (some NFS / Lustre mounts) and a record from another host: how to check it, and what to remove then."""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / LOCK).write_text(json.dumps({"pid": 4242, "host": "node-7", "started": 0.0, "job": None}))
    with pytest.raises(ValueError) as refused, hold_run_folder(tmp_path):
        pass
    assert str(refused.value).endswith(
        f"This host cannot check it: if it is gone (ssh node-7 ps -p 4242), remove {tmp_path / LOCK}."
    )
