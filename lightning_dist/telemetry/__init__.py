"""Training telemetry: loss history, throughput, communication per mesh axis, memory."""

from lightning_dist.telemetry.callback import Telemetry
from lightning_dist.telemetry.comm import CommTracker, OpStats, axis_groups_from_mesh, register_ddp_comm_hook
from lightning_dist.telemetry.history import LossHistory

__all__ = ["CommTracker", "LossHistory", "OpStats", "Telemetry", "axis_groups_from_mesh", "register_ddp_comm_hook"]
