"""Training telemetry: loss history, throughput, communication per mesh axis, memory.

The names below need torch and Lightning and are imported on first use (PEP 562): the launcher of
``lightning-dist-train`` imports :mod:`.report` (the summary it prints after the ranks end), and importing a
submodule runs this file first, so an eager import here would load torch into a process that trains nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dist.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
