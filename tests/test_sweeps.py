"""Hydra sweeps (``-m``): a point that fails does not end the sweep, and every point returns the metric a sweeper
optimizes (``objective``, ``val/loss`` by default). A failed point returns NaN to the basic sweeper and the worst value
(+-inf) to one that states its direction: Optuna's sweeper ends the whole sweep on NaN. Both sweepers run here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from helpers import FAST, fresh_env

from lightning_dist.run.result import RunResult
from lightning_dist.run.train import failed_value, objective_value, sweep_group

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


def test_optunas_sweeper_optimizes_and_survives_a_bad_point(tmp_path: Path) -> None:
    """hydra-optuna-sweeper (TPE, seeded): 4 trials over n_heads in {3, 4} and lr; the n_heads=3 trial fails in
    validation, and the study still ends with the best of the others."""
    overrides = [
        *FAST, "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.val_check_interval=2",
        "cluster.devices=1", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.sampler.seed=3", "model.n_heads=choice(3,4)", "optim.lr=interval(0.001,0.01)",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dist.run.train", "-m", *overrides],
        cwd=tmp_path, env=fresh_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error: model.n_heads=3 must divide model.d_model=64" in done.stderr, done.stderr[-3000:]
    results = (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    best = float(results.split("best_value:")[1].split()[0])
    reports = [json.loads(path.read_text()) for path in (tmp_path / "sweep").glob("*/report.json")]
    assert len(reports) == 3  # the failed trial wrote no report
    assert best == min(report["val_loss"] for report in reports)
    assert "model.n_heads: 4" in results


def test_a_failed_point_is_the_worst_value_for_a_sweeper_with_a_direction() -> None:
    from omegaconf import OmegaConf

    assert math.isnan(failed_value(OmegaConf.create({"_target_": "BasicSweeper"})))
    assert failed_value(OmegaConf.create({"direction": "minimize"})) == math.inf
    assert failed_value(OmegaConf.create({"direction": ["maximize"]})) == -math.inf
    assert failed_value(OmegaConf.create({"optim": {"maximize": False}})) == math.inf
