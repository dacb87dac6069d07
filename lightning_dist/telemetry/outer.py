"""DiLoCo's outer synchronization in the telemetry: ``diloco/`` metrics and the ``comm/dp_replicate/`` axis.

Under ``sync=diloco`` the replicas exchange nothing in an inner step; every H steps (per fragment) one exchange over
the ``dp_replicate`` group carries the pseudo-gradient (an all-reduce; compressed, an all-to-all and an all-gather).
The :class:`~lightning_dist.telemetry.comm.CommTracker` counts it as it is issued, reported under its own axis
(:data:`~lightning_dist.telemetry.comm.OUTER_AXIS`) rather than ``dp``
(:meth:`~lightning_dist.telemetry.comm.CommTracker.apart`: what the outer work issues on the replica group), and
:class:`OuterSyncMeter` times the whole outer work of a step (pseudo-gradient, host backup copies, the exchange, the
outer SGD, the copy back) through :attr:`lightning_dist.parallel.diloco.DiLoCo.timer`:

- CPU: the host clock (the outer step is synchronous there).
- CUDA: an event before and after, read at logging time only, so a step without an outer step does nothing more and
  reads nothing. An outer step itself waits for the device anyway: the averaged pseudo-gradient is copied to the
  host backup (``parallel/diloco.py``), a host read inherent to keeping the outer state in host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from time import perf_counter
from typing import Any

import torch

from lightning_dist.parallel.compression import exchange_sizes
from lightning_dist.telemetry.comm import BUS_FACTORS, OUTER_AXIS, CommTracker

#: The keys :meth:`OuterSyncMeter.metrics` returns (all cumulative since the fit started; max over ranks).
DILOCO_KEYS = (
    "diloco/outer_steps",
    "diloco/bytes_per_outer_step",
    "diloco/bytes_per_step",
    "diloco/bus_bytes_per_step",
    "diloco/outer_ms",
    "diloco/outer_fraction",
)


class OuterSyncMeter:
    """Times DiLoCo's outer steps and reads their bytes from the tracker's ``dp_replicate`` axis.

    Args:
        diloco: The strategy's :class:`~lightning_dist.parallel.diloco.DiLoCo` (its ``group`` is the replica group).
        tracker: The installed tracker; the outer steps' collectives go to its :data:`OUTER_AXIS`.
        device_type: ``"cuda"`` times with CUDA events; anything else with the host clock.
    """

    def __init__(self, diloco: Any, tracker: CommTracker, device_type: str) -> None:
        self.diloco, self.tracker = diloco, tracker
        self.use_cuda_events = device_type == "cuda"
        self.seconds = 0.0  #: time inside outer steps so far (CUDA: as of the last :meth:`flush`)
        self.timed = 0  #: inner steps that did outer work
        self.train_seconds = 0.0  #: training time of the logging windows so far
        self._pending: list[tuple[Any, Any]] = []
        self._group_size = diloco.num_replicas
        # fp32: one all-reduce per exchange; compressed: an all-to-all and an all-gather (parallel/compression.py)
        self._ops_per_exchange = len(exchange_sizes(1, diloco.compression, diloco.num_replicas))
        diloco.timer = self.time

    @classmethod
    def attach(cls, strategy: Any, tracker: CommTracker | None, device_type: str) -> OuterSyncMeter | None:
        """A meter on ``strategy``'s DiLoCo, or ``None`` (no DiLoCo, or no tracker: one process)."""
        diloco = getattr(strategy, "diloco", None)
        if diloco is None or tracker is None:
            return None
        return cls(diloco, tracker, device_type)

    def detach(self) -> None:
        """Stop timing (DiLoCo runs its outer steps untimed again)."""
        self.flush()
        if self.diloco.timer == self.time:
            self.diloco.timer = nullcontext

    @contextmanager
    def time(self) -> Iterator[None]:
        """Time what runs inside, its collectives on the replica axis (DiLoCo's
        :attr:`~lightning_dist.parallel.diloco.DiLoCo.timer`)."""
        self.timed += 1
        if self.use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = perf_counter()
        try:
            group = self.diloco.group  # None: one replica, nothing exchanged (and None would mean the default group)
            with self.tracker.apart(OUTER_AXIS, group) if group is not None else nullcontext():
                yield
        finally:
            if self.use_cuda_events:
                end.record()
                self._pending.append((start, end))
            else:
                self.seconds += perf_counter() - began

    def flush(self) -> None:
        """Add the finished CUDA events' time (logging steps only: reading an event waits for it)."""
        for start, end in self._pending:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
        self._pending = []

    def metrics(self, steps: int, window_seconds: float) -> dict[str, float]:
        """``diloco/`` values after ``steps`` inner steps since the fit started, the last logging window having taken
        ``window_seconds`` of training (validation left out).

        ``outer_steps`` counts the exchanges on the replica axis (one per fragment's outer step); bytes are the
        tracker's (nccl-tests' size, as ``comm/<axis>/bytes``); ``bus_bytes`` x the op's bus factor (what a ring
        moves per rank, the bytes a link's bandwidth divides). ``outer_ms`` is per exchange.
        """
        self.flush()
        self.train_seconds += window_seconds
        calls = size = bus = 0.0
        for (axis, op), stats in self.tracker.stats.items():
            if axis == OUTER_AXIS:
                calls += stats.count
                size += stats.bytes
                bus += stats.bytes * BUS_FACTORS[op](self._group_size)
        steps = max(steps, 1)
        exchanges = calls / self._ops_per_exchange
        outer_steps = exchanges or self.timed  # one replica: no collective, the outer SGD still runs
        return {
            "diloco/outer_steps": exchanges,
            "diloco/bytes_per_outer_step": size / exchanges if exchanges else 0.0,
            "diloco/bytes_per_step": size / steps,
            "diloco/bus_bytes_per_step": bus / steps,
            "diloco/outer_ms": self.seconds / outer_steps * 1e3 if outer_steps else 0.0,
            "diloco/outer_fraction": self.seconds / self.train_seconds if self.train_seconds > 0 else 0.0,
        }
