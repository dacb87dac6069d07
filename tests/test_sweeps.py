"""Hydra sweeps (``-m``): a point that fails does not end the sweep, and every point returns the metric a sweeper
optimizes (``objective``, ``val/loss`` by default; NaN for a failed point). Any sweeper (basic, Optuna, Nevergrad)
reads the same return value; the basic one runs here (an optimizing sweeper's package pins another Hydra)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from helpers import FAST, fresh_env

from lightning_dist.run.result import RunResult
from lightning_dist.run.train import objective_value, sweep_group

TESTS = Path(__file__).resolve().parent


def test_a_sweep_survives_a_bad_point_and_returns_the_objective(tmp_path: Path) -> None:
    returns = tmp_path / "returns.jsonl"
    overrides = [
        *FAST, "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.val_check_interval=2",
        "cluster.devices=1", "model.n_heads=3,4",  # 3 does not divide d_model=64: that point fails in validation
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "+hydra.callbacks.record._target_=sweep_record.RecordReturns", f"+hydra.callbacks.record.path={returns}",
    ]  # fmt: skip
    env = fresh_env(PYTHONPATH=os.pathsep.join([str(TESTS / "support"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dist.run.train", "-m", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error: model.n_heads=3 must divide model.d_model=64" in done.stderr, done.stderr[-3000:]
    jobs = [json.loads(line) for line in returns.read_text().splitlines()]
    assert [job["overrides"][-1] for job in jobs] == ["model.n_heads=3", "model.n_heads=4"]
    assert math.isnan(float(jobs[0]["value"]))
    good = float(jobs[1]["value"])
    assert 0 < good < 10  # the point's val/loss (a ~5.5 nats start on a 256-token vocabulary)
    report = json.loads((tmp_path / "sweep" / "1" / "report.json").read_text())
    assert good == report["val_loss"]


def test_the_objective_is_the_last_logged_value() -> None:
    history = [{"step": 0, "val/ppl": 9.0}, {"step": 1}, {"step": 2, "val/ppl": 7.0}]
    result = RunResult(output_dir="x", layout="ddp", train_loss=2.5, val_loss=1.5, history=history)
    assert objective_value(result, "val/loss") == 1.5
    assert objective_value(result, "train/loss") == 2.5
    assert objective_value(result, "val/ppl") == 7.0
    assert math.isnan(objective_value(result, "val/acc"))
    assert sweep_group("multirun/2026-11-24/20-30-00") == "sweep-2026-11-24-20-30-00"
