"""Training telemetry: loss history, throughput, communication per mesh axis, memory.

The names below need torch and Lightning and are imported on first use (PEP 562): the launcher of
``lightning-dist-train`` imports :mod:`.report` (the summary it prints after the ranks end), and importing a
submodule runs this file first, so an eager import here would load torch into a process that trains nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dist.telemetry.callback import Telemetry
    from lightning_dist.telemetry.comm import CommTracker, OpStats, axis_groups_from_mesh, register_ddp_comm_hook
    from lightning_dist.telemetry.history import LossHistory

#: Public name -> the module that defines it, imported on first use.
_LAZY = {
    "CommTracker": "lightning_dist.telemetry.comm",
    "LossHistory": "lightning_dist.telemetry.history",
    "OpStats": "lightning_dist.telemetry.comm",
    "Telemetry": "lightning_dist.telemetry.callback",
    "axis_groups_from_mesh": "lightning_dist.telemetry.comm",
    "register_ddp_comm_hook": "lightning_dist.telemetry.comm",
}

__all__ = ["CommTracker", "LossHistory", "OpStats", "Telemetry", "axis_groups_from_mesh", "register_ddp_comm_hook"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
