"""The ``Telemetry`` callback: ``perf/``, ``comm/<axis>/``, ``memory/`` and ``pipeline/`` metrics every few steps.

Always on (cheap): two clock reads per batch and, per collective, a dict lookup and two additions (calls and bytes,
see :mod:`lightning_dist.telemetry.comm`). Sampled: the *time* of collectives, on one optimizer step in
``comm_timing_every_n_steps`` (on CPU a host timer has to wait for each collective, which takes away its overlap with
compute, so by default only the last step of each logging window is timed; CUDA events cost no wait and time every
step). At logging steps only: one all-reduce of a small tensor for the min / max across ranks, CUDA event reads, and
a write to the loggers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_dist.contract import data_parallel_kwargs, strategy_view
from lightning_dist.telemetry.comm import (
    AXIS_ORDER,
    CommTracker,
    OpStats,
    axis_groups_from_mesh,
    register_ddp_comm_hook,
)
from lightning_dist.telemetry.outer import OuterSyncMeter
from lightning_dist.telemetry.tables import comm_table, format_summary, layout_table, write_csv
from lightning_dist.telemetry.throughput import (
    batch_size_and_tokens,
    find_flops_per_token,
    model_state_bytes,
    parameter_count,
    peak_tflops,
    resident_memory_bytes,
    seq_len_of,
)

_GIB = 1024**3
#: Metric prefixes defined on Lightning's step axis in W&B.
METRIC_PREFIXES = ("perf", "comm", "memory", "pipeline")


def _parallel_dims(strategy: Any) -> Any | None:
    """``strategy.parallel_dims`` with its mesh built, or None (Lightning's own strategies have none)."""
    view = strategy_view(strategy)
    if view is None:
        return None
    try:
        dims = view.parallel_dims
        dims.mesh  # noqa: B018 - raises when the strategy has not built the mesh
        return dims
    except RuntimeError:  # our strategies raise a clear error when read before setup
        return None


class Telemetry(pl.Callback):
    """Throughput, MFU, communication per mesh axis and memory, logged every ``log_every_n_steps`` optimizer steps.

    Works with our ``TensorParallelStrategy`` / ``PipelineParallelStrategy`` (axes read from
    ``strategy.parallel_dims``) and with Lightning's ``DDPStrategy`` / ``FSDPStrategy`` (the default group is the
    ``dp`` axis). Metrics go to every logger of the Trainer on global rank 0 (W&B, CSV, ...).

    Logged keys (per optimizer step, averaged over the steps since the last log; validation runs inside fit are
    left out of every time):

    - ``perf/step_ms`` (+ ``_min`` / ``_max`` across ranks), ``perf/data_ms``, ``perf/data_fraction``,
      ``perf/tokens_per_sec`` (global: this rank's tokens x the data-parallel size, so the ``tp x pp`` ranks that
      share a batch count it once), ``perf/tokens_per_sec_per_device`` (global / world size),
      ``perf/samples_per_sec``, ``perf/tflops_per_device`` and ``perf/mfu`` (when FLOPs per token and a peak are
      known).
    - ``comm/<axis>/calls`` and ``comm/<axis>/bytes`` (every step counted) for the axes ``dp``, ``tp``, ``pp`` (and
      ``world`` / ``other`` for groups that are no single axis); from the timed steps of the window:
      ``comm/<axis>/ms`` (+ ``_min`` / ``_max``), ``comm/<axis>/busbw_gbps``, ``comm/total_ms`` (+ ``_min`` /
      ``_max``), ``comm/fraction`` (of the timed steps' own time, data loading included) and ``comm/timed_steps``.
      A window without a timed step (``comm_timing_every_n_steps`` larger than the logging period) logs no times.
    - ``memory/peak_allocated_gib`` / ``memory/peak_reserved_gib`` (CUDA), ``memory/rss_gib`` (host), and the model
      states a rank holds: ``memory/params_gib``, ``memory/grads_gib``, ``memory/optimizer_gib``; max over ranks.
    - ``pipeline/bubble_fraction`` (and its min / max over ranks) under ``PipelineParallelStrategy``.
    - Under ``sync=diloco``: the outer exchange as ``comm/dp_replicate/``, and ``diloco/`` totals since the start
      (:mod:`lightning_dist.telemetry.outer`).

    At the end of ``fit``: a table of communication per axis and op and a table of the layout (rank -> mesh
    coordinates) go to W&B (``telemetry/comm``, ``telemetry/layout``), or as CSV files next to ``metrics.csv`` for a
    CSVLogger, and are printed on rank 0.

    Args:
        log_every_n_steps: Logging period in optimizer steps; default the Trainer's ``log_every_n_steps``.
        flops_per_token: Training FLOPs (forward + backward) per token; default ``pl_module.flops_per_token`` or
            ``pl_module.model.flops_per_token(seq_len)``; a module that states none is estimated at 6 x its parameters
            (forward + backward of the matmuls, attention not counted), logged as ``perf/flops_estimated=1``.
        peak_tflops: Peak TFLOP/s per device for MFU; default from the table for known CUDA devices (omitted on CPU).
        track_comm: Intercept collectives (see :mod:`lightning_dist.telemetry.comm`): count every call and time a
            sample of the steps.
        comm_timing_every_n_steps: Time the collectives of one optimizer step in this many (the steps whose 1-based
            number is a multiple of it). Default: every step on CUDA; elsewhere the last step of each logging window,
            because timing there waits for each collective inside the call.
        print_summary: Print the end-of-fit tables on rank 0 (a function: hand it their text instead).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        flops_per_token: float | None = None,
        peak_tflops: float | None = None,
        track_comm: bool = True,
        comm_timing_every_n_steps: int | None = None,
        print_summary: bool | Callable[[str], None] = True,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1 (or None for the Trainer's).")
        if comm_timing_every_n_steps is not None and comm_timing_every_n_steps < 1:
            raise ValueError(
                f"comm_timing_every_n_steps={comm_timing_every_n_steps} must be >= 1 "
                "(or None: every step on CUDA, once per logging window elsewhere)."
            )
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.track_comm = track_comm
        self.comm_timing_every_n_steps = comm_timing_every_n_steps
        self.print_summary = print if print_summary is True else print_summary or None
        #: Every logged metrics dict (on every rank; the numbers are the same everywhere after the cross-rank sync).
        self.history: list[dict[str, float]] = []
        #: End-of-fit tables: ``{"comm": (columns, rows), "layout": (columns, rows)}``.
        self.tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
        self.tracker: CommTracker | None = None
        self._reset_fit_state()

    def _reset_fit_state(self) -> None:
        self._every = self._time_every = 1
        self._timed_step_began = 0.0
        self._validation_began: float | None = None
        self._timing_before_validation = False
        self._timed_steps, self._timed_seconds = 0, 0.0
        self._dims: Any = None
        self._world_size = self._dp_size = 1
        self._device = torch.device("cpu")
        self._peak: float | None = None
        self._last_global_step = 0
        self._num_steps = 0
        self._window_start: float | None = None
        self._last_end: float | None = None
        self._steps_in_window = 0
        self._data_seconds = 0.0
        self._tokens = self._samples = 0
        self._seq_len: int | None = None
        self._comm_at_last_log: dict[tuple[str, str], OpStats] = {}
        self._estimated_flops: float | None = None
        self._outer: OuterSyncMeter | None = None

    # ------------------------------------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall()  # a Telemetry reused for a second fit starts clean
        self.tracker = None
        self._reset_fit_state()
        self._every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        self._dims = _parallel_dims(trainer.strategy)
        self._world_size = trainer.world_size
        self._dp_size = self._data_parallel_size(trainer)
        self._device = pl_module.device
        self._last_global_step = trainer.global_step
        self._peak = self.peak_tflops
        if self._peak is None and self._device.type == "cuda":
            self._peak = peak_tflops(torch.cuda.get_device_name(self._device), str(trainer.precision))
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        if self.flops_per_token is None and find_flops_per_token(pl_module, 1) is None:
            # Before the tracker is installed: counting the model's size is not the training's communication.
            self._estimated_flops = 6.0 * parameter_count(pl_module, self._pp_group())
        if self.track_comm and dist.is_available() and dist.is_initialized() and self._world_size > 1:
            groups = axis_groups_from_mesh(self._dims.mesh) if self._dims is not None else None
            self._time_every = self.comm_timing_every_n_steps or (1 if self._device.type == "cuda" else self._every)
            self.tracker = CommTracker(groups, device_type=self._device.type, timing=False).install()
            model = trainer.strategy.model
            if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not register_ddp_comm_hook(model):
                pl.utilities.rank_zero_warn(  # torch's own hooks call torch.distributed in Python: those are counted
                    "Telemetry: the DDP model already has a comm hook; comm/dp counts what it sends through "
                    "torch.distributed (torch's compression hooks do), not a C++ path."
                )
            self._outer = OuterSyncMeter.attach(trainer.strategy, self.tracker, self._device.type)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                for prefix in METRIC_PREFIXES:  # our keys against Lightning's step, whatever W&B's own step is
                    logger.experiment.define_metric(f"{prefix}/*", step_metric="trainer/global_step")

    def _pp_group(self) -> Any:
        return self._dims.group("pp") if self._dims is not None and self._dims.pp_enabled else None

    def _data_parallel_size(self, trainer: pl.Trainer) -> int:
        if self._dims is not None:
            return self._dims.dp_size
        kwargs = data_parallel_kwargs(trainer.strategy) or {}
        return int(kwargs.get("num_replicas", trainer.world_size))

    # ----------------------------------------------------------------------------------------- per batch
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        now = perf_counter()
        if self._window_start is None:
            self._window_start = now
        if self._last_end is not None:
            self._data_seconds += now - self._last_end  # the dataloader ran between the two hooks
        samples, tokens = batch_size_and_tokens(batch)
        self._samples += samples
        self._tokens += tokens
        if self._seq_len is None:
            self._seq_len = seq_len_of(batch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        now = perf_counter()
        self._last_end = now
        if trainer.global_step == self._last_global_step:  # gradient accumulation: not an optimizer step yet
            return
        self._steps_in_window += trainer.global_step - self._last_global_step
        self._num_steps += trainer.global_step - self._last_global_step
        self._last_global_step = trainer.global_step
        if self.tracker is not None and self.tracker.timing:
            self._timed_steps += 1
            self._timed_seconds += now - self._timed_step_began
            self.tracker.timing = False
        if trainer.global_step % self._every == 0:
            self._log(trainer, pl_module, now)
            self._last_end = perf_counter()  # the logging itself is not data loading
        self._decide_timing(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._decide_timing(trainer)

    def _decide_timing(self, trainer: pl.Trainer) -> None:
        """Time the next optimizer step, or only count it; from here, not from its first batch: Lightning's loop
        communicates between the two (its per-step SIGTERM broadcast, where a straggler's delay lands)."""
        if self.tracker is not None:
            self.tracker.timing = (trainer.global_step + 1) % self._time_every == 0
            self._timed_step_began = perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation run inside fit is no part of any training step: its collectives are counted, not timed,
        # and its duration is taken out of the step, data and window clocks.
        self._validation_began = perf_counter()
        if self.tracker is not None:
            self._timing_before_validation, self.tracker.timing = self.tracker.timing, False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_began is None:
            return
        took = perf_counter() - self._validation_began
        self._validation_began = None
        self._timed_step_began += took
        if self._last_end is not None:
            self._last_end += took
        if self._window_start is not None:
            self._window_start += took
        if self.tracker is not None:
            self.tracker.timing = self._timing_before_validation

    # -------------------------------------------------------------------------------------------- logging
    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, now: float) -> None:
        """The window's metrics: this rank's values, their min / max over the ranks, then what is logged."""
        seconds = now - self._window_start
        per_axis: dict[str, OpStats] = {}
        for (axis, _op), stats in self._comm_since_last_log().items():
            per_axis.setdefault(axis, OpStats()).add(stats)
        local = self._local_values(trainer, pl_module, seconds, per_axis)
        low, high = self._min_max(local)
        metrics = self._throughput(pl_module, local, low, high, seconds)
        metrics.update(self._comm_metrics(local, low, high, per_axis))
        for key in [k for k in local if k.startswith(("memory/", "diloco/", "replicas/"))]:
            metrics[key] = high[key]
        if "pipeline/bubble_fraction" in local:
            key = "pipeline/bubble_fraction"
            metrics.update({key: local[key], f"{key}_min": low[key], f"{key}_max": high[key]})
        self.history.append({"step": float(trainer.global_step), **metrics})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self._window_start = perf_counter()
        self._steps_in_window = 0
        self._data_seconds = 0.0
        self._tokens = self._samples = 0
        self._timed_steps = 0
        self._timed_seconds = 0.0

    def _local_values(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, seconds: float, per_axis: dict[str, OpStats]
    ) -> dict[str, float]:
        """This rank's values of the window: step and data time, calls and time per axis, memory, the pipeline's
        bubble, DiLoCo's outer step; the same keys on every rank (the timed steps follow ``global_step``)."""
        steps, timed = self._steps_in_window, self._timed_steps
        local: dict[str, float] = {
            "perf/step_ms": seconds / steps * 1e3,
            "perf/data_ms": self._data_seconds / steps * 1e3,
        }
        for axis in AXIS_ORDER:
            stats = per_axis.get(axis, OpStats())
            local[f"comm/{axis}/calls"] = stats.count / steps
            if timed:
                local[f"comm/{axis}/ms"] = stats.seconds / timed * 1e3
        if timed:
            local["comm/total_ms"] = sum(s.seconds for s in per_axis.values()) / timed * 1e3
            local["comm/timed_step_ms"] = self._timed_seconds / timed * 1e3
        if self._device.type == "cuda":
            local["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self._device) / _GIB
            local["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(self._device) / _GIB
            torch.cuda.reset_peak_memory_stats(self._device)
        local["memory/rss_gib"] = resident_memory_bytes() / _GIB
        for part, size in model_state_bytes(pl_module, trainer.optimizers).items():
            local[f"memory/{part}_gib"] = size / _GIB
        view = strategy_view(trainer.strategy)
        bubble = view.pop_bubble_fraction() if view is not None else None
        if bubble is not None:
            local["pipeline/bubble_fraction"] = bubble
        if self._outer is not None:
            local.update(self._outer.metrics(self._num_steps, seconds))
        replicas = getattr(trainer.strategy, "replicas", None)  # fault-tolerant replica groups (torchft)
        if replicas is not None:
            local.update(replicas.metrics())
        return local

    def _throughput(
        self,
        pl_module: pl.LightningModule,
        local: dict[str, float],
        low: dict[str, float],
        high: dict[str, float],
        seconds: float,
    ) -> dict[str, float]:
        """Step and data time over the ranks; tokens, samples and FLOPs per second; MFU."""
        metrics: dict[str, float] = {}
        timed = self._timed_steps
        synced = ("perf/step_ms", "perf/data_ms", "comm/total_ms") if timed else ("perf/step_ms", "perf/data_ms")
        for key in synced:
            metrics.update({key: local[key], f"{key}_min": low[key], f"{key}_max": high[key]})
        metrics["perf/data_fraction"] = local["perf/data_ms"] / local["perf/step_ms"]
        tokens_per_sec = self._tokens * self._dp_size / seconds
        metrics["perf/tokens_per_sec"] = tokens_per_sec
        metrics["perf/tokens_per_sec_per_device"] = tokens_per_sec / self._world_size
        metrics["perf/samples_per_sec"] = self._samples * self._dp_size / seconds
        flops_per_token = self.flops_per_token or find_flops_per_token(pl_module, self._seq_len)
        if flops_per_token is None and self._estimated_flops is not None:
            flops_per_token = self._estimated_flops
            metrics["perf/flops_estimated"] = 1.0
        if flops_per_token:
            tflops = flops_per_token * tokens_per_sec / self._world_size / 1e12
            metrics["perf/tflops_per_device"] = tflops
            if self._peak:
                metrics["perf/mfu"] = tflops / self._peak
        return metrics

    def _comm_metrics(
        self, local: dict[str, float], low: dict[str, float], high: dict[str, float], per_axis: dict[str, OpStats]
    ) -> dict[str, float]:
        """Calls, bytes, time and bus bandwidth of each axis that moved anything on any rank."""
        metrics: dict[str, float] = {}
        steps, timed = self._steps_in_window, self._timed_steps
        for axis in AXIS_ORDER:
            if high[f"comm/{axis}/calls"] == 0:  # the axis moved nothing on any rank
                continue
            stats = per_axis.get(axis, OpStats())
            metrics[f"comm/{axis}/calls"] = local[f"comm/{axis}/calls"]
            metrics[f"comm/{axis}/bytes"] = stats.bytes / steps
            if timed:
                metrics[f"comm/{axis}/ms"] = local[f"comm/{axis}/ms"]
                metrics[f"comm/{axis}/ms_min"] = low[f"comm/{axis}/ms"]
                metrics[f"comm/{axis}/ms_max"] = high[f"comm/{axis}/ms"]
                metrics[f"comm/{axis}/busbw_gbps"] = stats.busbw_gbps
        if timed:
            metrics["comm/fraction"] = local["comm/total_ms"] / local["comm/timed_step_ms"]
            metrics["comm/timed_steps"] = float(timed)
        return metrics

    def _comm_since_last_log(self) -> dict[tuple[str, str], OpStats]:
        if self.tracker is None:
            return {}
        now = self.tracker.snapshot()
        delta = {key: stats.minus(self._comm_at_last_log.get(key, OpStats())) for key, stats in now.items()}
        self._comm_at_last_log = now
        return delta

    def _min_max(self, local: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Min and max of every value across ranks, with one all-reduce (MAX of the values and their negatives)."""
        if not (dist.is_available() and dist.is_initialized()) or self._world_size == 1:
            return local, local
        keys = sorted(local)  # the same order on every rank
        values = torch.tensor([local[k] for k in keys] + [-local[k] for k in keys], dtype=torch.float64, device="cpu")
        # NCCL reduces device tensors only; gloo takes CPU ones.
        device = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        values = values.to(device)
        if self.tracker is not None:
            with self.tracker.paused():  # our own sync is not the training's communication
                dist.all_reduce(values, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        values = values.cpu().tolist()
        high = dict(zip(keys, values[: len(keys)]))
        low = {k: -v for k, v in zip(keys, values[len(keys) :])}
        return low, high

    # ----------------------------------------------------------------------------------------- end of fit
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        totals = self.tracker.snapshot() if self.tracker is not None else {}
        self.tables = {"comm": comm_table(totals), "layout": layout_table(self._dims, trainer.world_size)}
        self._uninstall()
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                for name, (columns, rows) in self.tables.items():
                    logger.log_table(key=f"telemetry/{name}", columns=columns, data=rows)
            elif isinstance(logger, CSVLogger):
                for name, (columns, rows) in self.tables.items():
                    write_csv(Path(logger.log_dir) / f"telemetry_{name}.csv", columns, rows)
        if self.print_summary:
            self.print_summary(format_summary(self.tables, self._num_steps))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        if self._outer is not None:
            self._outer.detach()
        if self.tracker is not None:
            self.tracker.flush()
            self.tracker.uninstall()
