"""Lightning callbacks that keep a long run safe, for the app and for your own ``Trainer``: periodic, published
checkpoints (:class:`RunCheckpoints`), preemption signals (:class:`Preemption`) and hang detection
(:class:`Heartbeat`), and a progress bar that reads the loss only on logging steps (:class:`LoggedLossBar`)."""

from lightning_dist.callbacks.checkpoints import InitWeights, RunCheckpoints
from lightning_dist.callbacks.heartbeat import Heartbeat
from lightning_dist.callbacks.preemption import Preemption
from lightning_dist.callbacks.progress import LoggedLossBar

__all__ = ["Heartbeat", "InitWeights", "LoggedLossBar", "Preemption", "RunCheckpoints"]
