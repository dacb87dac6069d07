"""``examples/cli.py``: LightningCLI with our GPT, data, strategies and callbacks, run as a user would run it.

The strategy and a callback are given as class paths on the command line; Lightning's own launcher starts the ranks.
The tp=2 and pp=2 runs must log the loss curve of the one-process run (rtol 1e-5).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import fresh_env

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
COMMON = [
    "fit", "--trainer.accelerator=cpu", f"--trainer.max_steps={STEPS}", f"--model.max_steps={STEPS}",
    "--model.model.d_model=32", "--model.model.n_layers=2", "--data.cfg.global_batch_size=4", "--data.cfg.seq_len=32",
    "--trainer.enable_checkpointing=false", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false", "--trainer.callbacks+=lightning_dist.callbacks.Preemption",
    "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
]  # fmt: skip


def _losses(tmp_path: Path, name: str, layout: list[str]) -> list[float]:
    folder = tmp_path / name
    command = [sys.executable, str(ROOT / "examples" / "cli.py"), *COMMON, f"--trainer.logger.save_dir={folder}"]
    env = fresh_env()  # no launcher variables another test left behind (MASTER_ADDR of a fake srun)
    done = subprocess.run([*command, *layout], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = folder.glob("lightning_logs/version_*/metrics.csv")
    with metrics.open() as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses(tmp_path_factory.mktemp("cli"), "one", ["--trainer.devices=1"])


@pytest.mark.parametrize(
    "layout",
    [
        ["--trainer.strategy=lightning_dist.TensorParallelStrategy", "--trainer.strategy.tp=2"],
        # The same CLI path with another strategy class (pipelines: tests/distributed/test_pipeline*.py).
        pytest.param(
            ["--trainer.strategy=lightning_dist.PipelineParallelStrategy", "--trainer.strategy.pp=2"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["tp2", "pp2"],
)
def test_lightning_cli_with_our_strategy_matches_one_process(layout: list[str], one: list[float], tmp_path) -> None:
    assert len(one) == STEPS
    np.testing.assert_allclose(_losses(tmp_path, "two", ["--trainer.devices=2", *layout]), one, rtol=1e-5)
