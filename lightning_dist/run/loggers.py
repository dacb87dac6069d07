"""The run's logger: Lightning's own WandbLogger (offline unless W&B is configured) or CSVLogger, continued on resume.

A resumed run continues its folder's logs instead of starting over: the W&B run of the same id (``resume="allow"``)
and the same ``metrics.csv``, keeping the rows logged before the checkpoint's step (Lightning's CSV writer deletes
the file when it opens it; the resumed run logs the later steps again).
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_dist import _compat
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
        run_id = _wandb_run_id(out_dir) if continue_from is not None else None
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        for field in ("entity", "group"):
            if getattr(cfg, field) is not None:
                kwargs[field] = getattr(cfg, field)
        return WandbLogger(
            project=wandb_project(cfg),
            name=cfg.name or run_name(run_cfg, out_dir),
            save_dir=str(out_dir),
            tags=list(cfg.tags),
            config=asdict(run_cfg),
            **kwargs,
        )
    raise ValueError(f"logger.kind={cfg.kind!r} is unknown; use logger=wandb, logger=csv or logger=none.")


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
    """The id of the W&B run in ``out_dir`` (its folder is ``[offline-]run-<time>-<id>``), if there is one."""
    runs = sorted((out_dir / "wandb").glob("*run-*-*"))
    return runs[-1].name.rsplit("-", 1)[-1] if runs else None


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))
