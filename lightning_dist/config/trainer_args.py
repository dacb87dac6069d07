"""The ``trainer`` group: Lightning's ``Trainer`` arguments, the ones a run sets typed, every other one passed through.

A Lightning user writes ``trainer.max_epochs=2`` or ``+trainer.profiler=simple`` and expects it to reach the
``Trainer``; an argument the app owns (the strategy, logger, callbacks) or a setting that moved out of ``trainer.``
(telemetry, restarts) is one line naming where it lives now.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

#: Every argument of Lightning's ``Trainer`` (2.6); ``tests/unit/test_trainer_args.py`` checks it against the
#: installed Lightning. Listed rather than read from Lightning so the launcher checks a config without importing it.
LIGHTNING_TRAINER_ARGS: tuple[str, ...] = (
    "accelerator",
    "strategy",
    "devices",
    "num_nodes",
    "precision",
    "logger",
    "callbacks",
    "fast_dev_run",
    "max_epochs",
    "min_epochs",
    "max_steps",
    "min_steps",
    "max_time",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "overfit_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
    "log_every_n_steps",
    "enable_checkpointing",
    "enable_progress_bar",
    "enable_model_summary",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "deterministic",
    "benchmark",
    "inference_mode",
    "use_distributed_sampler",
    "profiler",
    "detect_anomaly",
    "barebones",
    "plugins",
    "sync_batchnorm",
    "reload_dataloaders_every_n_epochs",
    "default_root_dir",
    "enable_autolog_hparams",
    "model_registry",
)


@dataclass
class TrainerConfig:
    """Arguments of Lightning's ``Trainer``. The fields below are typed and checked before any process starts; any
    other ``Trainer`` argument passes through as given (``+trainer.profiler=simple``, ``+trainer.max_time=00:12:00:00``)
    and is kept in :attr:`extra`."""

    max_steps: int = 300
    """Optimizer steps to train for; -1 = no limit (train by ``max_epochs``)."""
    max_epochs: int | None = None
    """Epochs to train for; with ``max_steps`` too, the run stops at whichever comes first."""
    fast_dev_run: Any = False
    """Lightning's smoke test: true (or n) runs 1 (n) training and validation batches, without checkpoints or
    logger."""
    val_check_interval: Any = 100
    """Validate every this many training steps (an int), or this fraction of an epoch (a float <= 1)."""
    limit_val_batches: Any = 8
    """Validation batches per validation run (an int), or this fraction of the validation set (a float)."""
    num_sanity_val_steps: int = 1
    """Validation batches run before training as a sanity check."""
    log_every_n_steps: int = 10
    """Log metrics (and telemetry) every this many steps."""
    accumulate_grad_batches: int = 1
    """Lightning's gradient accumulation. Built-in data: sets data.micro_batch_size to the per-rank batch / this (the
    global batch stays data.global_batch_size); data=custom: your loader's batch x this x dp is the global batch."""
    gradient_clip_val: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    enable_checkpointing: bool = True
    """Save a checkpoint at the end of training (ModelCheckpoint, last.ckpt)."""
    enable_progress_bar: bool | None = None
    """Show Lightning's progress bar; None = when stdout is a terminal (never in files and CI logs)."""
    accelerator: str | None = None
    """Lightning's name for ``cluster.accelerator``: when set, it is that value."""
    devices: int | None = None
    """Lightning's name for ``cluster.devices`` (processes per node): when set, it is that value."""
    num_nodes: int | None = None
    """Lightning's name for ``cluster.num_nodes``: when set, it is that value."""
    precision: str | None = None
    """Lightning's name for ``cluster.precision``: when set, it is that value."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The other ``Trainer`` arguments given (``+trainer.<name>=...``), passed as they are."""


#: Trainer arguments the app sets itself, each with where the user sets it instead.
OWNED: dict[str, str] = {
    "strategy": "the layout is parallelism=... (parallelism.strategy and its degrees)",
    "logger": "use logger=wandb|csv|tensorboard|mlflow|many|none, or +logger.<name>._target_=<class>",
    "callbacks": "add yours with +callbacks.<name>._target_=<class> (or callbacks=best)",
    "plugins": "the cluster environment is chosen from the launcher; precision is trainer.precision",
    "default_root_dir": "use output_dir=<folder>",
    "use_distributed_sampler": "the app deals batches by data-parallel rank itself",
}
#: Settings that were ``trainer.*`` before and are not ``Trainer`` arguments -> where they live now.
MOVED: dict[str, str] = {
    "telemetry": "telemetry.enabled",
    "track_comm": "telemetry.track_comm",
    "comm_timing_every_n_steps": "telemetry.comm_timing_every_n_steps",
    "report": "telemetry.report",
    "max_restarts": "resilience.max_restarts",
    "hang_timeout_s": "resilience.hang_timeout_s",
    "on_nonfinite": "resilience.on_nonfinite",
}

#: Lightning 1's ``Trainer`` arguments that Lightning 2 removed -> what the app takes instead ({value}: the one given).
LIGHTNING_1: dict[str, str] = {
    "gpus": "cluster=gpu cluster.devices={value} (Lightning 2 counts them with devices=)",
    "num_processes": "cluster.devices={value}",
    "resume_from_checkpoint": "resume=<run folder> or ckpt_path={value}",
}


def typed_trainer(node: dict[str, Any]) -> TrainerConfig:
    """The ``trainer`` group as a :class:`TrainerConfig`: its fields typed, the other ``Trainer`` arguments in
    ``extra``.

    Raises:
        ValueError: A field has the wrong type, or a key is not a ``Trainer`` argument the run may set (one line
            naming it and the fix).
    """
    typed_names = {f.name for f in fields(TrainerConfig)} - {"extra"}
    node = dict(node)
    extra = dict(node.pop("extra", None) or {})  # a TrainerConfig written out and read back
    typed = {key: value for key, value in node.items() if key in typed_names}
    for key, value in node.items():
        if key in typed_names:
            continue
        if key in MOVED:
            raise ValueError(f"trainer.{key} is not a Trainer argument and moved: use {MOVED[key]}={value}.")
        if key in OWNED:
            raise ValueError(f"trainer.{key} is set by the app: {OWNED[key]}.")
        if key in LIGHTNING_1:
            instead = LIGHTNING_1[key].format(value="..." if value is None else value)
            raise ValueError(f"trainer.{key} is Lightning 1's; use {instead}.")
        if key not in LIGHTNING_TRAINER_ARGS:
            close = difflib.get_close_matches(key, [*LIGHTNING_TRAINER_ARGS, *MOVED], n=1)
            hint = f"did you mean trainer.{close[0]}? " if close else ""
            raise ValueError(
                f"trainer.{key} is not an argument of lightning.Trainer; {hint}`lightning-dist-train --help trainer` "
                "lists the run's, and any other of lightning.Trainer's passes as +trainer.<name>=..."
            )
        extra[key] = value
    try:
        trainer = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), typed))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise ValueError(f"trainer.{key}: {str(err).splitlines()[0]}") from None
    trainer.extra = extra
    return trainer


#: The ``Trainer`` arguments that are ``cluster.*`` fields under the same name.
CLUSTER_NAMES = ("accelerator", "devices", "num_nodes", "precision")


def adopt_lightning_names(trainer: TrainerConfig, cluster: Any) -> None:
    """``trainer.devices`` (and accelerator, num_nodes, precision), where given, become the ``cluster.*`` value: the
    one the layout, the launcher and the ``Trainer`` read."""
    for name in CLUSTER_NAMES:
        value = getattr(trainer, name)
        if value is not None:
            setattr(cluster, name, value)
            setattr(trainer, name, None)


def check_trainer(trainer: TrainerConfig) -> None:
    """The typed fields' ranges, and a note when ``max_epochs`` and ``max_steps`` both bound the run.

    Raises:
        ValueError: One line naming the field, its value and the fix.
    """
    for name in ("log_every_n_steps", "accumulate_grad_batches"):
        if getattr(trainer, name) < 1:
            raise ValueError(f"trainer.{name}={getattr(trainer, name)} must be >= 1.")
    if trainer.max_steps == 0 or trainer.max_steps < -1:
        raise ValueError(f"trainer.max_steps={trainer.max_steps} must be >= 1, or -1 (train by trainer.max_epochs).")
    if trainer.max_steps == -1 and trainer.max_epochs is None and not trainer.fast_dev_run:
        raise ValueError("trainer.max_steps=-1 needs trainer.max_epochs=<n>; the run would never end.")
    for name in ("val_check_interval", "limit_val_batches"):
        value = getattr(trainer, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"trainer.{name}={value!r} must be a count (int) or a fraction of the epoch (float).")
    if isinstance(trainer.val_check_interval, float) and not 0 < trainer.val_check_interval <= 1:
        raise ValueError(
            f"trainer.val_check_interval={trainer.val_check_interval} must be a fraction in (0, 1], or an int count."
        )
    if trainer.val_check_interval == 0:
        raise ValueError("trainer.val_check_interval=0 must be >= 1 steps (an int) or a fraction in (0, 1].")
