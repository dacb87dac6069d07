"""The pipeline bubble: how much of a rank's pipeline step is idle, measured and in theory."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from lightning_dist._compat import wrap_stage_chunks


class BubbleTimer:
    """The idle (bubble) fraction of a rank's pipeline steps: ``1 - compute time / step time``.

    Compute is the time inside the stages' forward / backward / weight-gradient chunks; everything else in a step is
    waiting on a peer or moving activations, which is what a schedule tries to hide. The chunk methods are wrapped on
    the stage objects themselves (the schedule calls them there). On CUDA the work is asynchronous, so each chunk and
    the step are bracketed by CUDA events and read once the step has finished (one host sync per step).

    Args:
        stages: This rank's stages.
        device: Their device.
    """

    def __init__(self, stages: Sequence[PipelineStage], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: list[tuple[Any, Any]] = []
        self._busy_s = 0.0
        self._step_s = 0.0
        self._in_step = False
        for stage in stages:
            wrap_stage_chunks(stage, self._timed)

    def _timed(self, chunk: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(chunk)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:  # validation's forward-only steps are not training steps
                return chunk(*args, **kwargs)
            if self._cuda:
                start, end = _cuda_event(), _cuda_event()
                start.record()
                try:
                    return chunk(*args, **kwargs)
                finally:
                    end.record()
                    self._events.append((start, end))
            start_s = time.perf_counter()
            try:
                return chunk(*args, **kwargs)
            finally:
                self._busy_s += time.perf_counter() - start_s

        return timed

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        """Time one schedule step (wrap ``schedule.step``); chunks count only inside it."""
        self._in_step = True
        try:
            if self._cuda:
                start, end = _cuda_event(), _cuda_event()
                start.record()
                yield
                end.record()
                end.synchronize()
                self._step_s += start.elapsed_time(end) / 1e3
                self._busy_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            else:
                start_s = time.perf_counter()
                yield
                self._step_s += time.perf_counter() - start_s
        finally:
            self._in_step = False
            self._events.clear()

    def pop_fraction(self) -> float | None:
        """The bubble fraction over the steps since the last call (``None`` before any step); resets the count."""
        if self._step_s == 0:
            return None
        fraction = max(0.0, 1.0 - self._busy_s / self._step_s)
        self._busy_s = self._step_s = 0.0
        return fraction


def theoretical_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a synchronous schedule with equal stages: ``(p - 1) / (v * m + p - 1)``.

    GPipe and 1F1B: ``v = 1``; interleaving ``v`` stages per rank cuts warm-up and cool-down by ``v``
    (Narayanan et al., 2021).
    """
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)
