"""Training telemetry: loss history, throughput, communication per mesh axis, memory."""

from lightning_dist.telemetry.history import LossHistory

__all__ = ["LossHistory"]
