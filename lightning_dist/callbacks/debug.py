"""Debugging aids (``debug=profile|memory``): a torch profiler trace of chosen optimizer steps, and CUDA memory history
with snapshots at the end and on an out-of-memory error. docs/how-to/debug.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_dist import _compat


class ProfileSteps(pl.Callback):
    """Trace optimizer steps ``first``..``last`` (1-based, as ``trainer.global_step`` reads after each) with
    ``torch.profiler``: CPU and CUDA activity, tensor shapes and memory, one Chrome-trace JSON per rank,
    ``<dirpath>/rank<r>_steps<first>-<last>.json`` (https://ui.perfetto.dev or chrome://tracing opens it).

    Args:
        dirpath: Where the traces go.
        first: The first step traced; the ones before are warm-up (compilation, allocator growth, first NCCL calls).
        last: The last step traced.
    """

    def __init__(self, dirpath: Path, first: int, last: int) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"debug.profile_from={first} and profile_to={last} must satisfy 1 <= from <= to.")
        self.dirpath, self.first, self.last = Path(dirpath), first, last
        self._profiler: profile | None = None
        #: The trace this rank wrote, once written.
        self.trace: Path | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._profiler is None and self.trace is None and trainer.global_step == self.first - 1:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._profiler is not None and trainer.global_step >= self.last:
            self._stop(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:  # the run ended inside the window: keep what was traced
            self._stop(trainer)

    def _stop(self, trainer: pl.Trainer) -> None:
        self._profiler.__exit__(None, None, None)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        last = min(self.last, trainer.global_step)
        self.trace = self.dirpath / f"rank{trainer.global_rank}_steps{self.first}-{last}.json"
        self._profiler.export_chrome_trace(str(self.trace))
        self._profiler = None


class CudaMemoryHistory(pl.Callback):
    """Record every CUDA allocation from the start of fit (torch's memory history, with stacks) and write a snapshot
    of it per rank at the end (``<dirpath>/rank<r>_end.pickle``) and on an out-of-memory error (``rank<r>_oom.pickle``);
    https://pytorch.org/memory_viz opens them. CUDA only (the app refuses ``debug.memory`` on CPU before launch).

    Args:
        dirpath: Where the snapshots go.
        max_entries: Allocation events kept (the newest).
    """

    def __init__(self, dirpath: Path, max_entries: int = 100_000) -> None:
        self.dirpath, self.max_entries = Path(dirpath), max_entries
        #: The snapshots this rank wrote.
        self.snapshots: list[Path] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not torch.cuda.is_available():
            raise ValueError("debug.memory=true records CUDA memory; this run has no CUDA device (use debug=profile).")
        _compat.record_cuda_memory_history(self.max_entries)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dump(trainer, "end")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, torch.OutOfMemoryError):
            self._dump(trainer, "oom")

    def _dump(self, trainer: pl.Trainer, when: str) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / f"rank{trainer.global_rank}_{when}.pickle"
        _compat.dump_cuda_memory_snapshot(str(path))
        self.snapshots.append(path)
