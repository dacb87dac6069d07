"""A known delay injected into one axis's collectives, and the bounds the telemetry must put it in."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

DELAY = 0.1  # s per slowed call: large next to what load adds (a busy 2-core run measured +28 ms on a 20 ms delay)


def slow_down(module: Any, group_pos: dict[str, int], slow_if: Callable[[Any], bool]) -> Callable[[], None]:
    """Make ``module.<name>`` sleep ``DELAY`` before calls whose group (argument ``group_pos[name]``) is ``slow_if``.

    Runs before the tracker installs, so the tracker times the slow version (as it would a slow link). The same
    function object is replaced on torch.distributed and distributed_c10d, as the tracker expects. Returns the undo.
    """
    undo = []
    for name, pos in group_pos.items():
        original = getattr(module, name)

        def slow(*args: Any, _fn: Callable = original, _pos: int = pos, **kwargs: Any) -> Any:
            if slow_if(kwargs["group"] if "group" in kwargs else args[_pos] if len(args) > _pos else None):
                time.sleep(DELAY)
            return _fn(*args, **kwargs)

        for holder in (module, dist, dist.distributed_c10d):
            if getattr(holder, name, None) is original:
                setattr(holder, name, slow)
                undo.append((holder, name, original))

    def restore() -> None:
        for holder, name, original in reversed(undo):
            setattr(holder, name, original)

    return restore


def check_added(gained_ms: float, added_ms: float) -> None:
    assert 0.75 * added_ms <= gained_ms <= 1.5 * added_ms, f"{gained_ms:.1f} ms gained for {added_ms:.1f} ms added"
