"""Checkpoints during the run, published only when complete, and ``resume`` continuing a run in its own folder."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import FAST, compose_config, losses, run_app

from lightning_dist.checkpoint import LATEST, RunCheckpoints, complete_checkpoints, latest_checkpoint

LAYOUT = ["parallelism=fsdp", "cluster.devices=2", "optim.decay_steps=10", "logger=csv"]
SAVING = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=3", "checkpoint.keep_last=2"]


def test_checkpoints_during_the_run_then_resume_in_the_same_folder(tmp_path: Path) -> None:
    whole = run_app([*FAST, *LAYOUT], tmp_path / "whole")  # 10 steps uninterrupted
    run_dir = tmp_path / "run"
    first = run_app([*FAST, *LAYOUT, *SAVING, "trainer.max_steps=7"], run_dir)
    # Saved at steps 3 and 6 and at the end (7); the newest two are kept, "latest" names the last.
    names = [p.name for p in complete_checkpoints(run_dir / "checkpoints")]
    assert names == ["step-00000006", "step-00000007"]
    assert (run_dir / "checkpoints" / LATEST).read_text().strip() == "step-00000007"
    assert first["checkpoint"] == str(run_dir / "checkpoints" / "step-00000007")
    assert not list((run_dir / "checkpoints").glob(".*partial"))

    resumed = run_app([*FAST, *LAYOUT, *SAVING, f"resume={run_dir}"], tmp_path / "elsewhere")
    assert resumed["output_dir"] == str(run_dir)  # continued in its own folder
    np.testing.assert_allclose(losses(first) + losses(resumed), losses(whole), rtol=1e-6)
    # One metrics.csv: the first run's rows kept, the resumed run's appended, every step once.
    with (run_dir / "csv" / "metrics.csv").open() as file:
        steps = [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]
    assert steps == list(range(10))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["resume=auto"], r"resume=auto: no complete checkpoint in .*checkpoints; give the folder of the run"),
        (["resume=/nonexistent/run"], r"resume=/nonexistent/run: no complete checkpoint in /nonexistent/run/check"),
        (["ckpt_path=/nonexistent/step-1"], r"ckpt_path=/nonexistent/step-1 does not exist"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 must be >= 1"),
        (["trainer.val_check_interval=0"], r"trainer.val_check_interval=0 must be >= 1"),
        (["checkpoint.keep_last=0"], r"checkpoint.keep_last=0 must be >= 1"),
        (["checkpoint.every_n_steps=0"], r"checkpoint.every_n_steps=0 must be >= 1"),
    ],
)
def test_runs_that_cannot_start_fail_before_launch(overrides: list[str], message: str, tmp_path: Path) -> None:
    from lightning_dist.app import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose_config([*FAST, *overrides], tmp_path / "new"))


def test_an_unwritable_run_folder_fails_before_any_rank_starts(tmp_path: Path) -> None:
    from lightning_dist.train import run

    blocker = tmp_path / "a-file"  # tests run as root here, which permissions do not stop: a file in the path does
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"output_dir=.*a-file/run is not writable \(Not a directory\)"):
        run(compose_config([*FAST, "cluster.devices=1"], blocker / "run"))


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    """A crash inside the save (here: the writer raises after writing part of it) publishes nothing."""
    dirpath = tmp_path / "checkpoints"
    strategy = SimpleNamespace(barrier=lambda: None, broadcast=lambda value: value)

    def save_checkpoint(path: Path) -> None:
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"half")
        if trainer.global_step == 6:
            raise KeyboardInterrupt  # killed while writing

    trainer = SimpleNamespace(global_step=3, is_global_zero=True, strategy=strategy, save_checkpoint=save_checkpoint)
    saver = RunCheckpoints(dirpath, every_n_steps=3, keep_last=1)
    saver.save(trainer)
    trainer.global_step = 6
    with pytest.raises(KeyboardInterrupt):
        saver.save(trainer)
    assert latest_checkpoint(dirpath) == dirpath / "step-00000003"
    assert complete_checkpoints(dirpath) == [dirpath / "step-00000003"]  # keep_last=1 never removed the only good one
    trainer.global_step = 9
    saver.save(trainer)  # the next save replaces the leftover partial folder and publishes
    assert latest_checkpoint(dirpath) == dirpath / "step-00000009"
    assert complete_checkpoints(dirpath) == [dirpath / "step-00000009"]
