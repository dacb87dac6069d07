"""What each rank runs: Lightning's ``Trainer.fit`` with the run's strategy, data, logger and callbacks."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_dist.callbacks.checkpoints import InitWeights, RunCheckpoints
from lightning_dist.callbacks.debug import CudaMemoryHistory, ProfileSteps
from lightning_dist.callbacks.evaluation import EvalCallback
from lightning_dist.callbacks.heartbeat import Heartbeat
from lightning_dist.callbacks.preemption import Preemption
from lightning_dist.callbacks.progress import LoggedLossBar
from lightning_dist.config.build import build_datamodule, build_module, build_strategy
from lightning_dist.config.schema import TrainConfig
from lightning_dist.config.start import run_record
from lightning_dist.config.validate import ValidRun, validate
from lightning_dist.data import TokenDataModule
from lightning_dist.environment import is_global_zero
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.run.cluster import SharedFolderCheck, enable_flight_recorder, lightning_environment
from lightning_dist.run.console import log_to, say
from lightning_dist.run.loggers import CheckpointArtifacts, build_loggers, finish_wandb, where
from lightning_dist.run.result import RunResult
from lightning_dist.run.watchdog import watch_external_job
from lightning_dist.strategies import MeshStrategy
from lightning_dist.telemetry import LossHistory, Telemetry
from lightning_dist.telemetry.history import merge_telemetry


def fit(
    run: ValidRun | TrainConfig, callbacks: Sequence[pl.Callback] = (), placement: Mapping[str, Any] | None = None
) -> RunResult:
    """Train on this rank with Lightning's ``Trainer.fit``; returns this rank's summary (rank 0's is printed).

    Args:
        run: The checked run :func:`~lightning_dist.config.validate.validate` returned (the app's launcher hands
            every rank the same one), or a config to check here (a rank started some other way, e.g. by a test).
        callbacks: Extra Lightning callbacks.
        placement: The ``Trainer`` arguments that place this process (``plugins``, ``devices``, ``num_nodes``);
            ``None``: ``cluster.devices`` and ``cluster.num_nodes``, and the launcher's cluster environment.
    """
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is not using a DistributedSampler.*")
    # Our data module resumes mid-epoch by optimizer step (StepSampler); Lightning cannot tell and warns.
    warnings.filterwarnings("ignore", ".*your dataloader is not resumable.*")
    valid = run if isinstance(run, ValidRun) else validate(run)
    cfg = valid.cfg
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.output_dir)
    if is_global_zero():
        log_to(out_dir)  # the lines this rank says go to <run>/train.log too
    datamodule = build_datamodule(cfg)
    module = build_module(cfg)
    continuing = cfg.ckpt_path is not None and Path(cfg.ckpt_path).parent == out_dir / "checkpoints"
    # Lightning's smoke test logs nothing (a W&B run would still be made by finish_wandb)
    nodes = {} if cfg.trainer.fast_dev_run else cfg.logger
    loggers = build_loggers(nodes, out_dir, cfg, continue_from=Path(cfg.ckpt_path) if continuing else None)
    ours = RunCallbacks.build(cfg, out_dir, loggers, callbacks)
    users = [instantiate(node) for node in cfg.callbacks.values()]  # callbacks=... / +callbacks.<name>._target_=
    for callback in users:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = str(out_dir / "best")  # beside checkpoints/, which is ours (RunCheckpoints)
    enable_flight_recorder(out_dir, cfg.cluster.accelerator)  # before the strategy creates the process group
    trainer = build_trainer(valid, loggers, ours.all, users, datamodule, placement)
    watchdog = watch_external_job(out_dir)  # torchrun / srun: no launcher of ours reads the heartbeats
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    finally:
        if watchdog is not None:
            watchdog.stop()
    if ours.artifacts is not None:
        ours.artifacts.log_newest(trainer)  # the final checkpoint (log_model=true), or the last of them (all)
    if ours.telemetry is not None:
        merge_telemetry(ours.history.records, ours.telemetry.history)
    return ours.result(trainer, valid, loggers, getattr(datamodule, "loss_floor", None))


@dataclass
class RunCallbacks:
    """The app's own callbacks for one run, and the ones its summary reads afterwards."""

    history: LossHistory
    checkpoint: RunCheckpoints
    preemption: Preemption
    shown: ShowLayout
    telemetry: Telemetry | None
    artifacts: CheckpointArtifacts | None
    profiler: ProfileSteps | None
    all: list[pl.Callback]

    @classmethod
    def build(
        cls, cfg: TrainConfig, out_dir: Path, loggers: Mapping[str, Any], extra: Sequence[pl.Callback] = ()
    ) -> RunCallbacks:
        """The callbacks ``cfg`` asks for, with ``extra`` (a caller's own) among them, in the order they run."""
        every = cfg.checkpoint
        checkpoint = RunCheckpoints(
            out_dir / "checkpoints",
            every.every_n_steps,
            every.every_n_minutes,
            every.keep_last,
            run_record(cfg, contents=is_global_zero()),  # rank 0 writes the record: it alone reads the data for it
            save_hf=every.save_hf,
        )
        history, preemption, shown = LossHistory(), Preemption(), ShowLayout()
        heartbeat = Heartbeat(cfg.resilience.hang_timeout_s)
        all_callbacks: list[pl.Callback] = [history, preemption, heartbeat, shown, *extra]
        telemetry = None
        if cfg.telemetry.enabled:
            telemetry = Telemetry(
                peak_tflops=cfg.cluster.peak_tflops,
                track_comm=cfg.telemetry.track_comm,
                comm_timing_every_n_steps=cfg.telemetry.comm_timing_every_n_steps,
                print_summary=say,
            )
            all_callbacks.append(telemetry)
        artifacts = None
        if cfg.trainer.enable_checkpointing and not cfg.trainer.fast_dev_run:  # Lightning's smoke test saves nothing
            all_callbacks.append(checkpoint)
            if cfg.eval.tasks:  # after RunCheckpoints: it evaluates the HuggingFace save just published
                all_callbacks.append(eval_callback(cfg, out_dir / "checkpoints"))
            wandb_name = next((name for name, log in loggers.items() if isinstance(log, WandbLogger)), None)
            if wandb_name is not None and cfg.logger[wandb_name].get("log_model"):
                artifacts = CheckpointArtifacts(checkpoint, loggers[wandb_name], cfg.logger[wandb_name]["log_model"])
                all_callbacks.append(artifacts)
        if cfg.trainer.enable_progress_bar:
            all_callbacks.append(LoggedLossBar())
        if cfg.init_from is not None and cfg.ckpt_path is None:  # a checkpoint, when continuing, holds newer weights
            all_callbacks.append(InitWeights(Path(cfg.init_from)))
        if cfg.cluster.num_nodes > 1:
            all_callbacks.append(SharedFolderCheck(out_dir))
        debug = cfg.debug
        profiler = ProfileSteps(out_dir / "profile", debug.profile_from, debug.profile_to) if debug.profile else None
        all_callbacks += [profiler] if profiler else []
        all_callbacks += [CudaMemoryHistory(out_dir / "memory", debug.memory_max_entries)] if debug.memory else []
        return cls(history, checkpoint, preemption, shown, telemetry, artifacts, profiler, all_callbacks)

    def result(
        self, trainer: pl.Trainer, valid: ValidRun, loggers: Mapping[str, Any], loss_floor: float | None
    ) -> RunResult:
        """This rank's summary of the finished ``trainer``."""
        out_dir = Path(valid.cfg.output_dir)
        metrics = trainer.callback_metrics
        wandb_name = next((name for name, log in loggers.items() if isinstance(log, WandbLogger)), None)
        profiler = self.profiler
        return RunResult(
            output_dir=str(out_dir),
            layout=valid.layout,
            devices=devices_of(trainer),
            steps=trainer.global_step,
            train_loss=float(metrics["train/loss"]) if "train/loss" in metrics else float("nan"),
            val_loss=float(metrics["val/loss"]) if "val/loss" in metrics else None,
            loss_floor=loss_floor,
            history=self.history.records,
            rank_layouts=[layout.to_dict() for layout in self.shown.layouts],
            checkpoint=str(self.checkpoint.last_path) if self.checkpoint.last_path else None,
            checkpoint_blocked_s=self.checkpoint.blocked_s,
            checkpoint_written_s=self.checkpoint.written_s,
            preempted=self.preemption.signal_name,
            wandb_dir=finish_wandb(loggers[wandb_name]) if wandb_name is not None else None,
            csv=next((where(log) for log in loggers.values() if isinstance(log, CSVLogger)), None),
            logs={
                **{name: where(log) for name, log in loggers.items() if where(log) and not isinstance(log, CSVLogger)},
                **({"profile trace": str(profiler.trace)} if profiler and profiler.trace else {}),
                **({"memory": str(out_dir / "memory")} if valid.cfg.debug.memory else {}),
            },
        )


def build_trainer(
    valid: ValidRun,
    loggers: Mapping[str, Any],
    callbacks: list[pl.Callback],
    users: list[pl.Callback],
    datamodule: Any,
    placement: Mapping[str, Any] | None = None,
) -> pl.Trainer:
    """Lightning's ``Trainer`` for the checked run: its strategy, precision, loop lengths, loggers, the app's
    ``callbacks`` and the user's (``users``, after them)."""
    cfg, args = valid.cfg, valid.cfg.trainer
    if args.max_epochs is not None and args.max_steps > 0 and is_global_zero():
        say(
            f"trainer.max_epochs={args.max_epochs} and trainer.max_steps={args.max_steps}: the run stops at "
            "whichever comes first (trainer.max_steps=-1 trains by epochs only)"
        )
    if placement is None:
        placement = {
            "plugins": lightning_environment(),
            "devices": cfg.cluster.devices,
            "num_nodes": cfg.cluster.num_nodes,
        }
    return pl.Trainer(
        **placement,
        accelerator=cfg.cluster.accelerator,
        strategy=build_strategy(cfg, valid.dims),
        precision=cfg.cluster.precision,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        fast_dev_run=args.fast_dev_run,
        accumulate_grad_batches=args.accumulate_grad_batches,
        val_check_interval=args.val_check_interval,
        # An int val_check_interval counts steps across epochs; a fraction needs the epoch boundaries.
        check_val_every_n_epoch=1 if isinstance(args.val_check_interval, float) else None,
        limit_val_batches=args.limit_val_batches,
        num_sanity_val_steps=args.num_sanity_val_steps,
        log_every_n_steps=args.log_every_n_steps,
        gradient_clip_val=args.gradient_clip_val,
        # Ours: RunCheckpoints. Lightning would add a ModelCheckpoint of its own, and refuses the user's without this.
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in users),
        enable_progress_bar=args.enable_progress_bar,
        enable_model_summary=False,
        logger=list(loggers.values()) or False,
        callbacks=[*callbacks, *users],
        # Our data module samples by data-parallel rank itself; a user's loaders are dealt out by our strategies.
        use_distributed_sampler=not isinstance(datamodule, TokenDataModule),
        default_root_dir=Path(cfg.output_dir),
        # Every other Trainer argument, as the user gave it (+trainer.profiler=simple), a node with _target_ built
        # (+trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiler +trainer.profiler.dirpath=...).
        **{name: _built(value) for name, value in args.extra.items()},
    )


def _built(value: Any) -> Any:
    """A ``Trainer`` argument given as a node with ``_target_`` built by Hydra; any other value as it is."""
    return instantiate(value) if isinstance(value, dict) and "_target_" in value else value


class ShowLayout(pl.Callback):
    """Print what each rank holds (``strategy.describe(all_ranks=True)``) once the model is laid out, and keep it for
    the run report. Mesh strategies only: Lightning's DDP holds the whole model on every rank."""

    #: Ranks printed at start-up (all of them go to the report).
    PRINTED = 8

    def __init__(self) -> None:
        self.layouts: list[RankLayout] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):
            return
        self.layouts = trainer.strategy.describe(all_ranks=True)
        if trainer.is_global_zero:
            lines = [line for layout in self.layouts[: self.PRINTED] for line in layout.lines()]
            if len(self.layouts) > self.PRINTED:
                lines.append(f"... {len(self.layouts) - self.PRINTED} more ranks in report.json")
            say("what each rank holds (strategy.describe()):\n  " + "\n  ".join(lines))


def eval_callback(cfg: TrainConfig, checkpoints: Path) -> EvalCallback:
    """``eval.*``: lm-eval tasks on each evaluated checkpoint's HuggingFace save (``callbacks/evaluation.py``)."""
    ev = cfg.eval
    limit = None if ev.limit is None else int(ev.limit) if ev.limit >= 1 else ev.limit
    return EvalCallback(
        checkpoints,
        ev.tasks,
        ev.every_n_steps or cfg.checkpoint.every_n_steps,
        include_path=ev.include_path,
        limit=limit,
        num_fewshot=ev.num_fewshot,
        batch_size=ev.batch_size,
    )


def devices_of(trainer: pl.Trainer) -> str:
    """What the run ran on, e.g. ``2 x CPU`` or ``8 x NVIDIA H100 80GB HBM3`` (the processes and this rank's device)."""
    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    return f"{trainer.world_size} x {name}"
