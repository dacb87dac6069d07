"""A run folder belongs to one run: a new run into a folder that holds another's checkpoints, a second job started on
a folder in use, and a resume that would change the run's data stream or learning rate each stop before launch with
one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FAST, compose_config, run_app

from lightning_dist.checkpoint.store import RUN_RECORD, run_record_of
from lightning_dist.config.start import run_record
from lightning_dist.config.validate import validate
from lightning_dist.run.lock import LOCK

RUN = [*FAST, "parallelism=ddp", "cluster.devices=1", "trainer.max_steps=2", "trainer.enable_checkpointing=true"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder holding a finished run's checkpoint (step 2)."""
    run_dir = tmp_path_factory.mktemp("finished")
    run_app(RUN, run_dir)
    return run_dir


def test_a_new_run_into_a_folder_holding_a_runs_checkpoints_is_refused(finished: Path) -> None:
    message = (
        rf"^output_dir={finished} already holds a run's checkpoints \(newest step-00000002\); continue it with "
        rf"resume={finished}, or start a new run in a new folder \(output_dir=\.\.\.\)\.$"
    )
    for starts_from in ([], [f"init_from={finished / 'checkpoints' / 'step-00000002'}"]):
        with pytest.raises(ValueError, match=message):
            validate(compose_config([*RUN, *starts_from], finished))
    assert validate(compose_config([*RUN, f"resume={finished}"])).cfg.output_dir == str(finished)


def test_a_new_run_into_a_finished_runs_folder_without_checkpoints_is_refused(tmp_path: Path) -> None:
    """The probe: a finished run without checkpoints had its metrics.csv and report.json replaced by a new run into
    its folder, silently."""
    run = [*FAST, "parallelism=ddp", "cluster.devices=1", "trainer.max_steps=2", "logger=csv"]
    run_app(run, tmp_path)
    kept = {name: (tmp_path / name).read_bytes() for name in ("report.json", "csv/metrics.csv")}
    with pytest.raises(ValueError) as refused:
        run_app([*run, "seed=7"], tmp_path)
    assert str(refused.value) == (
        f"output_dir={tmp_path} already holds another run's results (report.json, csv/metrics.csv) and no checkpoint "
        "to continue it from; a new run there would replace them: start it in a new folder (output_dir=...), or move "
        "them away first."
    )
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept


def test_each_checkpoint_notes_what_defines_its_run(finished: Path) -> None:
    """What the resume check compares against: written by the run itself, equal to its resolved config's record."""
    recorded = run_record_of(finished / "checkpoints" / "step-00000002")
    assert recorded == run_record(validate(compose_config(RUN, finished / "elsewhere")).cfg)
    assert recorded["seed"] == 1234 and recorded["data.global_batch_size"] == 8 and RUN_RECORD == "lightning_dist_run"


def test_a_resume_that_changes_the_data_stream_or_lr_says_so_and_needs_the_override(
    finished: Path, capfd: pytest.CaptureFixture
) -> None:
    # trainer.max_steps 2 -> 20 is no change of the run: its 2 steps were in the warmup (20 steps) of either schedule
    changed = ["seed=7", "data.global_batch_size=16", "optim.lr=0.001", "trainer.max_steps=20"]
    message = (
        rf"^resume={finished} continues a run with other values: data.global_batch_size 8 -> 16, "
        r"optim.lr 0.003 -> 0.001, seed 1234 -> 7; it would not continue that run \(another data stream or LR "
        r"schedule\)\. Resume with the run's own values, or set resume_allow_changes=true to go on with these\.$"
    )
    with pytest.raises(ValueError, match=message):
        validate(compose_config([*RUN, *changed, f"resume={finished}"]))
    capfd.readouterr()
    allowed = validate(compose_config([*RUN, *changed, f"resume={finished}", "resume_allow_changes=true"])).cfg
    assert allowed.ckpt_path == str(finished / "checkpoints" / "step-00000002")
    warning = capfd.readouterr().err
    assert warning.startswith("warning: resume_allow_changes=true: continuing") and "seed 1234 -> 7" in warning
    # What only changes how the batch is computed (the micro batch) is no change of the run.
    validate(compose_config([*RUN, "data.micro_batch_size=4", f"resume={finished}"]))


def test_two_jobs_started_on_one_folder_the_second_is_refused(tmp_path: Path) -> None:
    """Through the console script, as a user starts them; the first runs on to its end."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "lightning_dist.run.train", *FAST, "cluster.devices=1", f"output_dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    first = subprocess.Popen(
        [*command, "trainer.max_steps=30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 120
    while not ((run_dir / LOCK).is_file() and (run_dir / LOCK).read_text()):  # the first job holds the folder
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
        time.sleep(0.1)
    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 1
    last_line = second.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: output_dir={run_dir} is in use by another run (pid {first.pid} on "), last_line
    assert "Traceback" not in second.stderr
    _, stderr = first.communicate(timeout=180)
    assert first.returncode == 0, stderr[-2000:]
    assert (run_dir / LOCK).read_text() == ""  # released at its end


def test_a_resumed_runs_error_is_logged_in_its_own_folder_and_nothing_strays(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Through the console script: Hydra's run folder is the run ``resume`` names (no ``outputs/<date>/<time>``
    made in the working folder), and the rank's traceback goes to that run's ``error.log``."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.run.train import main

    GlobalHydra.instance().clear()
    monkeypatch.chdir(tmp_path)
    failing = "+callbacks.bad._target_=nowhere.Callback"  # built in the rank: it fails there, with a traceback
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", *RUN, f"resume={finished}", failing])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: rank 0: ") and f"(traceback: {finished / 'error.log'})" in line, line
    newest = finished / "checkpoints" / "step-00000002"
    assert line.endswith(f"; left on disk: {newest} (resume={finished} continues from it)"), line  # what to go on from
    assert "nowhere" in (finished / "error.log").read_text()
    assert list(tmp_path.iterdir()) == []
    assert (finished / ".hydra" / "config.yaml").is_file()  # Hydra's record of this start, in the run's folder
