"""The heartbeat file between a rank and its launcher: a rank writes its step and the silence it allows, the launcher
reads it.

Plain Python, apart from the :class:`~lightning_dist.callbacks.heartbeat.Heartbeat` callback that decides when to
beat: the launcher (:mod:`lightning_dist.run.launch`) names each rank's file (``ENV``) and reads it without
importing torch or Lightning, and a checkpoint save marks itself busy (:func:`busy`) through the same file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The environment variable that holds this rank's beat file (set by the launcher; unset: beats are no-ops).
ENV = "LIGHTNING_DIST_HEARTBEAT"
#: The silence allowed while a rank is busy: the first steps, validation, a save, the end of training.
BUSY_S = 1800.0


def beat(step: int, allowed_s: float) -> None:
    """Record that this rank is alive at ``step`` and may be silent for ``allowed_s`` (no-op without a launcher)."""
    path = os.environ.get(ENV)
    if not path:
        return
    partial = Path(f"{path}.partial")
    partial.write_text(f"{step} {allowed_s:.1f}\n")
    os.replace(partial, path)


def read(path: Path) -> tuple[int, float, float] | None:
    """``(step, allowed_s, age_s)`` of a beat file, or ``None`` before the first beat."""
    try:
        step, allowed = path.read_text().split()
        return int(step), float(allowed), time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None


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
