"""The run's loggers: Lightning loggers built from ``_target_`` (``logger=wandb|csv|tensorboard|mlflow|many``),
continued on resume.

Any Lightning logger can be named; a ``save_dir`` left null is the run folder. W&B, CSV, TensorBoard and MLflow get
what the app knows on top: W&B is offline unless configured and named after the run; a resumed run continues its
folder's logs instead of starting over, keeping what was logged before the checkpoint: the same ``metrics.csv`` (its
rows before the checkpoint's step; Lightning's CSV writer deletes the file when it opens it), TensorBoard's events
with the later steps purged, and the same W&B run. Online, W&B rewinds that run's history to the step noted with the
checkpoint (``resume_from``); offline, or with no step noted, the run is continued by id (``resume="allow"``). See
docs/concepts/telemetry.md.
"""

from __future__ import annotations

import csv
import inspect
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import get_class
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from lightning_dist import _compat
from lightning_dist.callbacks.checkpoints import RunCheckpoints, wandb_step_of
from lightning_dist.config.schema import HFModelConfig, TargetConfig, TrainConfig
from lightning_dist.environment import is_global_zero
from lightning_dist.models.gpt_config import GPTConfig


def build_loggers(
    nodes: dict[str, dict[str, Any]], out_dir: Path, run_cfg: TrainConfig, continue_from: Path | None = None
) -> dict[str, Logger]:
    """Each ``logger.<name>`` node built (see :func:`build_logger`), by name."""
    return {name: build_logger(node, out_dir, run_cfg, continue_from) for name, node in nodes.items()}


def build_logger(node: dict[str, Any], out_dir: Path, run_cfg: TrainConfig, continue_from: Path | None = None):
    """The Lightning logger a ``_target_`` node describes, set up for this run.

    Args:
        node: ``_target_`` (the class's import path) and its arguments; a ``save_dir`` that is null or absent is
            ``out_dir`` for a class that takes one.
        out_dir: The run folder.
        run_cfg: The whole run's config (logged to W&B, its names).
        continue_from: The checkpoint (``<out_dir>/checkpoints/step-<N>``) this run continues, or ``None``.
    """
    kwargs = dict(node)
    cls = get_class(kwargs.pop("_target_"))
    if kwargs.get("save_dir") is None and "save_dir" in inspect.signature(cls).parameters:
        kwargs["save_dir"] = str(out_dir)
    if issubclass(cls, WandbLogger):
        cls = RewindingWandbLogger if cls is WandbLogger else cls  # Lightning's own gets the rewind's fallback
        return cls(**_wandb_arguments(kwargs, out_dir, run_cfg, continue_from))
    if issubclass(cls, MLFlowLogger):
        kwargs.setdefault("run_name", None)
        kwargs["run_name"] = kwargs["run_name"] or run_name(run_cfg, out_dir)
        if kwargs.get("tracking_uri") is None:
            kwargs["tracking_uri"] = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{out_dir / 'mlruns'}"
        if kwargs["tracking_uri"].startswith("file:"):  # MLflow 3 refuses a file store unless asked for one
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if issubclass(cls, TensorBoardLogger) and continue_from is not None:
        kwargs.setdefault("purge_step", _step_of(continue_from))  # hides the steps logged after the checkpoint
    logger = cls(**kwargs)
    if isinstance(logger, CSVLogger) and continue_from is not None and is_global_zero():
        _continue_csv(logger, _step_of(continue_from))
    return logger


def where(logger: Logger) -> str | None:
    """Where a logger's records are, for the run summary: a folder, a file or a tracking URI."""
    if isinstance(logger, CSVLogger):
        return str(Path(logger.log_dir) / "metrics.csv")
    if isinstance(logger, MLFlowLogger):  # save_dir: a local store's folder, else None (a server)
        return f"{logger.save_dir or 'the tracking server'} (MLflow run {logger.run_id})"
    if isinstance(logger, WandbLogger):
        return None  # the W&B run's folder is known once it is finished (finish_wandb)
    return logger.log_dir or logger.save_dir


def _wandb_arguments(
    kwargs: dict[str, Any], out_dir: Path, run_cfg: TrainConfig, continue_from: Path | None
) -> dict[str, Any]:
    """A WandbLogger's arguments: the node's, with the project, name, mode and resumption the app decides."""
    mode = kwargs.pop("mode", None)
    if mode is not None:  # the user's explicit choice
        kwargs["mode"] = mode
    elif wandb_offline_by_default():
        kwargs["offline"] = True
    noted = wandb_step_of(continue_from) if continue_from is not None else None
    run_id = noted["run_id"] if noted else _wandb_run_id(out_dir) if continue_from is not None else None
    resume = {"id": run_id, "resume": "allow"}
    if noted and noted["step"] > 0 and wandb_mode(mode) in ("online", "run"):
        # W&B keeps the rows up to _step k and logs on from k + 1; WandbLogger's resume="allow" must go (wandb
        # refuses resume with resume_from).
        kwargs.update(resume_from=f"{run_id}?_step={noted['step'] - 1}", resume=None)
    elif run_id is not None:
        kwargs.update(resume)
    for field in ("entity", "group"):
        if kwargs.get(field) is None:
            kwargs.pop(field, None)  # W&B's own defaults (WANDB_ENTITY) apply
    kwargs["project"] = kwargs.get("project") or wandb_project()
    kwargs["name"] = kwargs.get("name") or run_name(run_cfg, out_dir)
    kwargs["tags"] = list(kwargs.get("tags") or [])
    kwargs.setdefault("config", asdict(run_cfg))
    kwargs["fallback"] = resume
    return kwargs


class RewindingWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger``; if wandb refuses its ``resume_from`` (a server without rewind), it continues the
    run by id (``fallback``: ``id``, ``resume="allow"``) and says, in one line, that steps may repeat.

    Args:
        fallback: What replaces ``resume_from`` in ``wandb.init``'s arguments on a refusal.
        **kwargs: ``WandbLogger``'s.
    """

    def __init__(self, *, fallback: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fallback = fallback
        init = _compat.wandb_init_kwargs(self)
        if init.get("anonymous") is None:  # wandb >= 0.19 warns about the setting even when it is None
            init.pop("anonymous", None)

    @property
    def experiment(self) -> Any:
        """The W&B run (started by rank 0 on first use)."""
        import wandb  # optional dependency: only a W&B logger gets here

        try:
            return WandbLogger.experiment.fget(self)
        except wandb.errors.Error as err:
            init = _compat.wandb_init_kwargs(self)
            if init.get("resume_from") is None:
                raise
            message = f"W&B refused to rewind run {self.fallback['id']} ({err}); continuing it with resume='allow'"
            print(f"warning: {message}: the steps since the checkpoint may appear twice", file=sys.stderr, flush=True)
            init.update(self.fallback, resume_from=None)
            return WandbLogger.experiment.fget(self)


def wandb_mode(mode: str | None = None) -> str:
    """The mode the W&B run will have: ``logger.wandb.mode``, else offline by default, else ``WANDB_MODE``, else
    online.

    wandb's own settings files (``wandb offline``) are not read: a run they make offline rewinds when synced.
    """
    if mode is not None:
        return mode
    if wandb_offline_by_default():
        return "offline"
    return os.environ.get("WANDB_MODE") or "online"


def wandb_project() -> str:
    """Where ``logger.wandb.project`` is null: ``WANDB_PROJECT``, else ``lightning-dist``."""
    return os.environ.get("WANDB_PROJECT") or "lightning-dist"


def run_name(run_cfg: TrainConfig, out_dir: Path) -> str:
    """What ran, where: the model, the layout and the run folder's name (``gpt-llama-d64-L2 fsdp 20-31-07``)."""
    model = run_cfg.model
    if isinstance(model, GPTConfig):
        what = f"gpt-{model.arch}-d{model.d_model}-L{model.n_layers}"
    elif isinstance(model, HFModelConfig):
        what = Path((model.pretrained or model.config or "hf").rstrip("/")).name
    elif isinstance(model, TargetConfig):
        what = model.target.rsplit(".", 1)[-1]
    else:
        what = type(model).__name__
    return f"{what} {run_cfg.parallelism.strategy} {out_dir.name}"


def wandb_offline_by_default() -> bool:
    """Offline unless the user configured W&B: ``WANDB_MODE`` (respected as is) or an API key (env or netrc)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return False
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))


def finish_wandb(logger) -> str | None:
    """Close the W&B run on rank 0; returns its local folder (for ``wandb sync``)."""
    if not isinstance(logger, WandbLogger) or not is_global_zero():
        return None
    import wandb  # optional dependency: only a W&B logger gets here

    run_dir = Path(logger.experiment.dir).parent  # .../wandb/offline-run-<id>/files -> the run folder
    wandb.finish()
    return str(run_dir)


class CheckpointArtifacts(pl.Callback):
    """``logger.wandb.log_model``: the run's checkpoints as W&B artifacts (type ``model``, named ``model-<run id>``,
    aliased ``latest`` and ``step-<N>``), as Lightning's own ``log_model`` does for a ``ModelCheckpoint``.

    ``True`` logs the final checkpoint once training ends; ``"all"`` each checkpoint once it is published (a
    complete folder). Offline, the files are staged by wandb and uploaded by ``wandb sync``. Rank 0 only.

    Args:
        checkpoints: The run's checkpoint callback (its ``last_path`` is the newest published checkpoint).
        logger: The W&B logger whose run gets the artifacts.
        every: ``True`` or ``"all"``.
    """

    def __init__(self, checkpoints: RunCheckpoints, logger: WandbLogger, every: bool | str) -> None:
        self.checkpoints, self.logger, self.every = checkpoints, logger, every
        self.logged: list[Path] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.every == "all":
            self.log_newest(trainer)

    def log_newest(self, trainer: pl.Trainer) -> None:
        """Log the newest published checkpoint unless it was logged already."""
        path = self.checkpoints.last_path
        if not trainer.is_global_zero or path is None or path in self.logged or not path.exists():
            return
        import wandb  # optional dependency: only a W&B logger gets here

        run = self.logger.experiment
        step = int(path.name.removeprefix("step-")) if path.name.startswith("step-") else trainer.global_step
        artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={"step": step})  # published a step later
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        run.log_artifact(artifact, aliases=["latest", path.name])
        self.logged.append(path)


def _continue_csv(logger, resume_step: int) -> None:
    """Keep the rows of ``metrics.csv`` logged before ``resume_step``; the writer then appends to them."""
    path = Path(logger.log_dir) / "metrics.csv"
    rows, header = [], []
    if path.is_file():
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            rows = [row for row in reader if row.get("step") and int(float(row["step"])) < resume_step]
    writer = logger.experiment  # Lightning's writer: opening it deletes metrics.csv
    if header:
        with path.open("w", newline="") as file:
            out = csv.DictWriter(file, fieldnames=header)
            out.writeheader()
            out.writerows(rows)
        _compat.set_csv_columns(writer, header)


def _wandb_run_id(out_dir: Path) -> str | None:
    """The id of the newest W&B run in ``out_dir``, if there is one.

    Its folder is ``[offline-]run-<time>-<id>[-<n>]`` (``-<n>`` when a folder of that second exists), so the id is
    read from the ``run-<id>.wandb`` file in it; the newest is the latest ``<time>``, online or offline.
    """
    logs = (out_dir / "wandb").glob("*run-*/run-*.wandb")
    newest = max(logs, key=lambda log: log.parent.name.removeprefix("offline-"), default=None)
    return newest.name.removeprefix("run-").removesuffix(".wandb") if newest else None


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))
