"""One job per run folder: the running job holds a lock on the run folder, so a second job started on the same folder
stops before launch instead of interleaving its ``metrics.csv`` rows and checkpoints with the first's.

The lock is the kernel's (``flock``) on the folder itself: it goes with the process that holds it on every exit path
(an exception, a signal, ``kill -9``), so a crashed job never leaves its folder locked, and no file removed by hand
releases it while its holder lives (a lock on ``.run.lock`` was released by deleting that file, which a refusal's
hint once suggested: a second run then wrote over the first's). ``<run>/.run.lock`` records who holds it (pid, host,
the process's start time, the job's id under torchrun / SLURM), which the refusal names (without the record, the
kernel's own table ``/proc/locks`` names the pid); a record left behind by a holder that is gone says the job ended
without releasing it (a crash), and the next job takes the folder over with one line saying so. On a filesystem
without ``flock`` (some Lustre and NFS mounts) the record alone decides: a holder on this host whose pid lives with
the same start time holds it, one on another host holds it unless it is an earlier start of the same torchrun / SLURM
job (a restart); only then, where this host cannot check the holder, does the refusal say how to check and what to
remove once it is gone.

The launcher holds it (ours), or global rank 0 (torchrun, ``srun``): its restarts take it again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_dist.environment import process_start_time

LOCK = ".run.lock"  #: in the run folder, held by the job that runs in it
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextmanager
def hold_run_folder(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs; released (its record cleared) however the block ends.

    Raises:
        ValueError: Another job holds it (one line naming it and the fixes).
    """
    path = Path(folder) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # the record
    lock = os.open(folder, os.O_RDONLY)  # the lock: on the folder, which no removed file releases
    try:
        _lock(lock, path, folder)
        _write_record(fd)
    except BaseException:
        os.close(fd)  # not ours: the holder's record stays
        os.close(lock)
        raise
    try:
        yield
    finally:
        os.ftruncate(fd, 0)  # released: an empty record
        os.close(fd)
        os.close(lock)  # and the kernel's lock with it


def _lock(fd: int, path: Path, folder: Path) -> None:
    previous = _read_record(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a live process holds it: the kernel drops a lock with its holder
        holder = _read_record(path) or previous or _flock_holder(fd)
        raise ValueError(_in_use(folder, holder)) from None
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            raise
        if previous and _alive(previous):  # no kernel lock on this filesystem: the record decides
            raise ValueError(_in_use(folder, previous, checked=previous.get("host") == socket.gethostname())) from None
    if previous:
        print(
            f"note: output_dir={folder} was left locked by {_holder(previous)}, which ended without releasing it "
            "(killed?); this run takes it over",
            file=sys.stderr,
            flush=True,
        )


def _in_use(folder: Path, holder: dict[str, Any], checked: bool = True) -> str:
    """The refusal: who holds ``folder``. ``checked``: its holder is known to live (the kernel's lock, or its pid on
    this host), so nothing is to be removed; else (another host, no ``flock``) how to check it, and what to remove
    once it is gone."""
    who = _holder(holder) if holder else "another process"
    line = (
        f"output_dir={folder} is in use by another run ({who}); wait for it to end, or start this run in a new "
        "folder (output_dir=...)."
    )
    pid, host = holder.get("pid"), holder.get("host")
    if checked:
        stop = f" (kill {pid}{f' on {host}' if host else ''})" if pid else ""
        return f"{line} It is running: stop it first{stop} if it must go; removing {LOCK} would not stop it."
    return f"{line} This host cannot check it: if it is gone (ssh {host} ps -p {pid}), remove {Path(folder) / LOCK}."


def _holder(record: dict[str, Any]) -> str:
    if "started" not in record:  # from the kernel's table: the pid only
        return f"pid {record.get('pid')}, its {LOCK} record removed"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return f"pid {record.get('pid')} on {record.get('host')}, started {started}"


def _flock_holder(fd: int) -> dict[str, Any]:
    """Who holds the ``flock`` on the file ``fd`` opens, from the kernel's table (Linux ``/proc/locks``): for a
    holder whose record was removed. ``{}`` where the table is not there or names no holder."""
    inode = os.fstat(fd).st_ino
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 7025 fe:00:260072 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return {"pid": int(fields[4]), "host": socket.gethostname()}
    return {}


def _alive(record: dict[str, Any]) -> bool:
    """Whether the process a record names still runs: on this host, its pid with the same start time; on another,
    unless it is an earlier start of this job (a torchrun / SLURM restart)."""
    if record.get("host") != socket.gethostname():
        return record.get("job") is None or record.get("job") != _job_id()
    pid = int(record.get("pid", 0))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it lives
    return abs(process_start_time(pid) - float(record.get("started", 0))) < 2  # not a new process with an old pid


def _read_record(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def _write_record(fd: int) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": process_start_time(os.getpid()),
        "job": _job_id(),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)


def _job_id() -> str | None:
    """The torchrun rendezvous id or the SLURM job id: the same across the job's restarts."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var) not in (None, "", "none"):
            return f"{var}={os.environ[var]}"
    return None
