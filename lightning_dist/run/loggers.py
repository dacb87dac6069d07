"""The run's logger: Lightning's own WandbLogger (offline unless W&B is configured) or CSVLogger, continued on resume.

A resumed run continues its folder's logs instead of starting over, keeping what was logged before the checkpoint:
the same ``metrics.csv`` (its rows before the checkpoint's step; Lightning's CSV writer deletes the file when it
opens it) and the same W&B run. Online, W&B rewinds that run's history to the step noted with the checkpoint
(``resume_from``); offline, or with no step noted, the run is continued by id (``resume="allow"``). See
docs/telemetry.md.
"""

from __future__ import annotations

import csv
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_dist import _compat
from lightning_dist.callbacks.checkpoints import wandb_step_of
from lightning_dist.config.environment import is_global_zero
from lightning_dist.config.schema import HFModelConfig, LoggerConfig, TargetConfig, TrainConfig
from lightning_dist.models.gpt_config import GPTConfig


def build_logger(cfg: LoggerConfig, out_dir: Path, run_cfg: TrainConfig, continue_from: Path | None = None):
    """Lightning's ``WandbLogger`` / ``CSVLogger``, or ``False`` for none.

    Args:
        cfg: The logger config.
        out_dir: The run folder.
        run_cfg: The whole run's config (logged to W&B).
        continue_from: The checkpoint (``<out_dir>/checkpoints/step-<N>``) this run continues, or ``None``.
    """
    if cfg.kind == "none":
        return False
    if cfg.kind == "csv":
        logger = CSVLogger(save_dir=out_dir, name="csv", version="")
        if continue_from is not None and is_global_zero():
            _continue_csv(logger, _step_of(continue_from))
        return logger
    if cfg.kind == "wandb":
        kwargs: dict[str, Any] = {}
        if cfg.mode is not None:  # the user's explicit choice
            kwargs["mode"] = cfg.mode
        elif wandb_offline_by_default():
            kwargs["offline"] = True
        noted = wandb_step_of(continue_from) if continue_from is not None else None
        run_id = noted["run_id"] if noted else _wandb_run_id(out_dir) if continue_from is not None else None
        resume = {"id": run_id, "resume": "allow"}
        if noted and noted["step"] > 0 and wandb_mode(cfg) in ("online", "run"):
            # W&B keeps the rows up to _step k and logs on from k + 1; WandbLogger's resume="allow" must go (wandb
            # refuses resume with resume_from).
            kwargs.update(resume_from=f"{run_id}?_step={noted['step'] - 1}", resume=None)
        elif run_id is not None:
            kwargs.update(resume)
        for field in ("entity", "group"):
            if getattr(cfg, field) is not None:
                kwargs[field] = getattr(cfg, field)
        return RewindingWandbLogger(
            project=wandb_project(cfg),
            name=cfg.name or run_name(run_cfg, out_dir),
            save_dir=str(out_dir),
            tags=list(cfg.tags),
            config=asdict(run_cfg),
            fallback=resume,
            **kwargs,
        )
    raise ValueError(f"logger.kind={cfg.kind!r} is unknown; use logger=wandb, logger=csv or logger=none.")


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


def wandb_mode(cfg: LoggerConfig) -> str:
    """The mode the W&B run will have: ``logger.mode``, else offline by default, else ``WANDB_MODE``, else online.

    wandb's own settings files (``wandb offline``) are not read: a run they make offline rewinds when synced.
    """
    if cfg.mode is not None:
        return cfg.mode
    if wandb_offline_by_default():
        return "offline"
    return os.environ.get("WANDB_MODE") or "online"


def wandb_project(cfg: LoggerConfig) -> str:
    """``logger.project``, else ``WANDB_PROJECT``, else ``lightning-dist``."""
    return cfg.project or os.environ.get("WANDB_PROJECT") or "lightning-dist"


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
    import wandb

    run_dir = Path(logger.experiment.dir).parent  # .../wandb/offline-run-<id>/files -> the run folder
    wandb.finish()
    return str(run_dir)


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
