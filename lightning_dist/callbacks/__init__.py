"""Lightning callbacks that keep a long run safe, for the app and for your own ``Trainer``: periodic, published
checkpoints (:class:`RunCheckpoints`), preemption signals (:class:`Preemption`) and hang detection
(:class:`Heartbeat`), a progress bar that reads the loss only on logging steps (:class:`LoggedLossBar`), and
lm-evaluation-harness on each checkpoint's HuggingFace save (:class:`EvalCallback`, ``lightning-dist[eval]``).

The callbacks need Lightning and are imported on first use (PEP 562): the launcher of ``lightning-dist-train``
imports :mod:`.beat_file` (the heartbeat file it reads), and importing a submodule runs this file first, so an eager
import here would load Lightning into a process that never builds a ``Trainer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dist.lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_dist.callbacks.checkpoints import InitWeights, RunCheckpoints
    from lightning_dist.callbacks.evaluation import EvalCallback
    from lightning_dist.callbacks.heartbeat import Heartbeat
    from lightning_dist.callbacks.preemption import Preemption
    from lightning_dist.callbacks.progress import LoggedLossBar

#: Public name -> the module that defines it, imported on first use.
_LAZY = {
    "EvalCallback": "lightning_dist.callbacks.evaluation",
    "Heartbeat": "lightning_dist.callbacks.heartbeat",
    "InitWeights": "lightning_dist.callbacks.checkpoints",
    "LoggedLossBar": "lightning_dist.callbacks.progress",
    "Preemption": "lightning_dist.callbacks.preemption",
    "RunCheckpoints": "lightning_dist.callbacks.checkpoints",
}

__all__ = ["EvalCallback", "Heartbeat", "InitWeights", "LoggedLossBar", "Preemption", "RunCheckpoints"]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
