"""The heartbeat file between a rank and its launcher: a rank writes its step and the silence it allows, the launcher
reads it.

Plain Python, apart from the :class:`~lightning_dist.callbacks.heartbeat.Heartbeat` callback that decides when to
beat: the launcher (:mod:`lightning_dist.run.launch`) names each rank's file (``ENV``) and reads it without
importing torch or Lightning, and a checkpoint save marks itself busy (:func:`busy`) through the same file.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The environment variable that holds this rank's beat file (set by the launcher; unset: beats are no-ops).
ENV = "LIGHTNING_DIST_HEARTBEAT"
#: The silence allowed while a rank is busy: the first steps, validation, a save, the end of training.
BUSY_S = 1800.0
_HOST = socket.gethostname()


def beat(step: int, allowed_s: float) -> None:
    """Record that this rank is alive at ``step`` and may be silent for ``allowed_s`` (no-op without a launcher)."""
    path = os.environ.get(ENV)
    if not path:
        return
    partial = Path(f"{path}.partial")
    partial.write_text(f"{step} {allowed_s:.1f} {os.getpid()} {_HOST}\n")
    os.replace(partial, path)


def read(path: Path) -> tuple[int, float, float] | None:
    """``(step, allowed_s, age_s)`` of a beat file, or ``None`` before the first beat."""
    try:
        step, allowed, *_ = path.read_text().split()
        return int(step), float(allowed), time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None


def writer(path: Path) -> tuple[int, str] | None:
    """``(pid, host)`` of the process that wrote a beat file, or ``None`` (no beat yet, or an older file)."""
    try:
        _, _, pid, host = path.read_text().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def most_silent(beats: dict[int, tuple[int, float, float] | None]) -> tuple[int, int, float, float] | None:
    """``(rank, step, allowed_s, age_s)`` of the rank silent longest past its allowance, or ``None`` if none is.

    A frozen rank stalls its peers in their next collective, so every beat goes quiet; the rank whose last beat is
    oldest is named (the one that stopped first, or one of those waiting on it).
    """
    silent = {rank: beat for rank, beat in beats.items() if beat is not None and beat[2] > beat[1]}
    if not silent:
        return None
    rank = max(silent, key=lambda r: silent[r][2])
    return (rank, *silent[rank])


def hung_message(rank: int, step: int, allowed_s: float, age_s: float) -> str:
    """The one line that names a hung rank (the launcher's and the watchdog's)."""
    return (
        f"rank {rank}: hung: no progress for {age_s:.0f} s after step {step} (allowed {allowed_s:.0f} s; "
        "resilience.hang_timeout_s); the job was stopped"
    )


_busy_until = 0.0  # when the last busy block ended (monotonic): step times are measured from there


@contextmanager
def busy(step: int, allowed_s: float = BUSY_S) -> Iterator[None]:
    """Allow ``allowed_s`` of silence inside the block (a checkpoint save), then the allowance from before."""
    global _busy_until
    path = os.environ.get(ENV)
    before = read(Path(path)) if path else None
    beat(step, allowed_s)
    try:
        yield
    finally:
        _busy_until = time.monotonic()
        beat(step, before[1] if before is not None else allowed_s)


def busy_until() -> float:
    """When the last :func:`busy` block of this process ended (``time.monotonic()``; 0.0 before the first)."""
    return _busy_until
