"""The run's own settings, checked before launch: its length and logging (``trainer.*``, with
:func:`~lightning_dist.config.trainer_args.check_trainer`), checkpoints, resilience and telemetry, and the user's
callbacks."""

from __future__ import annotations

from lightning_dist.config.loggers import check_loggers
from lightning_dist.config.schema import TrainConfig
from lightning_dist.config.trainer_args import check_trainer
from lightning_dist.errors import NONFINITE_ACTIONS


def check_run_fields(cfg: TrainConfig) -> None:
    """The run's length, logging, checkpoint and resilience settings, and the user's callbacks."""
    trainer, every, fault = cfg.trainer, cfg.checkpoint, cfg.resilience
    for name, node in cfg.callbacks.items():  # built in each rank; the launcher does not import them (start-up)
        target = node.get("_target_") if isinstance(node, dict) else None
        if not isinstance(target, str) or "." not in target:
            raise ValueError(
                f"callbacks.{name} has no _target_ (its class's import path); give "
                f"+callbacks.{name}._target_=lightning.pytorch.callbacks.ModelCheckpoint and its arguments."
            )
    check_loggers(cfg.logger)
    check_trainer(trainer)
    # A stream is one endless epoch (a pass over the sources starts the next); a user's DataModule has no data.kind.
    if getattr(cfg.data, "kind", None) == "hf" and cfg.data.streaming:
        if trainer.max_steps == -1:
            raise ValueError(
                "trainer.max_steps=-1 with data.streaming=true: a stream has no epochs (when every source is done it "
                "starts a second pass); set trainer.max_steps=<n>."
            )
        if cfg.data.val_path is not None and isinstance(trainer.val_check_interval, float):
            raise ValueError(
                f"trainer.val_check_interval={trainer.val_check_interval} is a fraction of an epoch, and a stream's "
                "one epoch has no end; give a count of steps (trainer.val_check_interval=<n>)."
            )
    cfg.debug.check(cfg.cluster.accelerator, trainer.max_steps)
    if every.every_n_steps is not None and every.every_n_steps < 1:
        raise ValueError(f"checkpoint.every_n_steps={every.every_n_steps} must be >= 1, or null (not by steps).")
    if every.every_n_minutes is not None and every.every_n_minutes <= 0:
        raise ValueError(f"checkpoint.every_n_minutes={every.every_n_minutes} must be > 0, or null (not by time).")
    if fault.hang_timeout_s is not None and fault.hang_timeout_s <= 0:
        raise ValueError(f"resilience.hang_timeout_s={fault.hang_timeout_s} must be > 0, or null (automatic).")
    if fault.max_restarts < 0:
        raise ValueError(f"resilience.max_restarts={fault.max_restarts} must be >= 0.")
    if fault.on_nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(
            f"resilience.on_nonfinite={fault.on_nonfinite!r} is unknown; use stop (end the run) or skip (drop such "
            "steps)."
        )
    if every.async_save and cfg.parallelism.strategy == "ddp":
        raise ValueError(
            "checkpoint.async_save=true needs a mesh layout (sharded checkpoints); parallelism=ddp saves one file: "
            "use parallelism=fsdp, or checkpoint.async_save=false."
        )
    if every.verify not in ("checksums", "sizes"):
        raise ValueError(f"checkpoint.verify={every.verify!r} is unknown; use checksums (the default) or sizes.")
    if every.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={every.keep_last} must be >= 1 (the newest checkpoint is always kept).")
    timing = cfg.telemetry.comm_timing_every_n_steps
    if timing is not None and timing < 1:
        raise ValueError(
            f"telemetry.comm_timing_every_n_steps={timing} must be >= 1, or null (every step on CUDA, "
            "once per logging window on CPU)."
        )
