"""Loggers by ``_target_`` (``logger=wandb|csv|tensorboard|mlflow|many|none``, several at once, any Lightning
logger): each writes what its own package reads back, offline; the old flat keys are one line naming the new ones."""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import FAST, compose_config, run_app

from lightning_dist.config.validate import validate

ONE_RANK = [o for o in FAST if not o.startswith(("logger=", "trainer.enable_checkpointing"))] + ["trainer.devices=1"]


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, os.environ.get(name, "")) if name in os.environ else monkeypatch.delenv(name, False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # offline: no W&B key anywhere
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_four_loggers_at_once_each_read_back_by_its_own_package(
    tmp_path: Path, quiet_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [*ONE_RANK, "logger=[csv,tensorboard,mlflow,wandb]", "logger.wandb.log_model=true"]
    run = tmp_path / "run"
    result = run_app([*overrides, "trainer.max_steps=6", "trainer.log_every_n_steps=2"], run)
    steps = [2, 4, 6]  # logged every 2 steps (Lightning's global_step after the step: 1, 3, 5 -> rows 1, 3, 5)

    rows = [row for row in csv.DictReader((run / "csv" / "metrics.csv").open()) if row.get("train/loss")]
    assert len(rows) == len(steps)
    csv_losses = [float(row["train/loss"]) for row in rows]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [round(event.value, 5) for event in events.Scalars("train/loss")] == [round(v, 5) for v in csv_losses]
    assert "perf/tokens_per_sec" in events.Tags()["scalars"]  # the telemetry reaches every logger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for its own file store
    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "lightning-dist"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert [round(metric.value, 5) for metric in history] == [round(v, 5) for v in csv_losses]
    assert mlflow_run.info.run_name == f"gpt-llama-d64-L2 ddp {run.name}"  # as W&B names it

    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    run_id = wandb_run.name.rsplit("-", 1)[-1]
    record = next(wandb_run.glob("run-*.wandb")).read_bytes()
    assert f"model-{run_id}".encode() in record and b"step-00000006" in record  # the final checkpoint's artifact

    assert result.csv == str(run / "csv" / "metrics.csv") and result.wandb_dir == str(wandb_run)
    assert set(result.logs) == {"tensorboard", "mlflow"}


def test_any_lightning_logger_by_target_writes_into_the_run_folder(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_dist.run.loggers import build_loggers

    target = "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger"
    cfg = compose_config(["logger=csv", target, "+logger.tb.name=mine"], tmp_path)
    validate(cfg)
    loggers = build_loggers(cfg.logger, tmp_path, cfg)
    assert isinstance(loggers["tb"], TensorBoardLogger) and loggers["tb"].log_dir.startswith(str(tmp_path / "mine"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+logger.tb.name=x"], r"^logger.tb has no _target_ \(its class's import path\); give \+logger.tb._target_="),
        (["+logger.c._target_=comet_ml_missing.Logger"], r"^logger.c._target_='comet_ml_missing.Logger': package"),
    ],
)
def test_a_logger_without_a_class_is_one_line_before_launch(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(compose_config(["logger=csv", *overrides]))


@pytest.mark.parametrize(
    ("arg", "line"),
    [
        ("logger.project=mine", "logger.project moved: use logger.wandb.project=mine"),
        ("logger.mode=online", "logger.mode moved: use logger.wandb.mode=online"),
        ("logger.kind=csv", "logger.kind is gone: choose the logger group, logger=wandb|csv|tensorboard|mlflow|many"),
    ],
)
def test_the_old_flat_logger_keys_name_their_new_place(arg: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist.run.train import main

    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", arg])
    with pytest.raises(SystemExit) as exited:
        main()
    assert re.match(re.escape(line), str(exited.value.code))
