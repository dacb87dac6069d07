"""Checkpoints during the run, published only when complete, and ``resume`` continuing a run in its own folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import FAST, compose_config, losses, run_app

from lightning_dist._compat import checkpoint_metadata_file
from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.checkpoint.folder import LATEST, MANIFEST, complete_checkpoints
from lightning_dist.checkpoint.store import latest_checkpoint

LAYOUT = ["parallelism=fsdp", "cluster.devices=2", "optim.decay_steps=10", "logger=csv"]
SAVING = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=3", "checkpoint.keep_last=2"]


def test_checkpoints_during_the_run_then_resume_in_the_same_folder(tmp_path: Path) -> None:
    """Written in the background (``async_save``): each is published only after its write, and holds its step."""
    whole = run_app([*FAST, *LAYOUT], tmp_path / "whole")  # 10 steps uninterrupted
    run_dir = tmp_path / "run"
    first = run_app([*FAST, *LAYOUT, *SAVING, "trainer.max_steps=7", "checkpoint.async_save=true"], run_dir)
    # Saved at steps 3 and 6 and at the end (7); the newest two are kept, "latest" names the last.
    names = [p.name for p in complete_checkpoints(run_dir / "checkpoints")]
    assert names == ["step-00000006", "step-00000007"]
    assert (run_dir / "checkpoints" / LATEST).read_text().strip() == "step-00000007"
    assert first["checkpoint"] == str(run_dir / "checkpoints" / "step-00000007")
    assert not list((run_dir / "checkpoints").glob(".*partial"))
    for checkpoint in complete_checkpoints(run_dir / "checkpoints"):  # hashed by each rank in the background
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        assert set(files) == {path.name for path in checkpoint.iterdir()} - {MANIFEST}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)  # both ranks' shards

    resumed = run_app([*FAST, *LAYOUT, *SAVING, "ckpt_path=last"], run_dir)  # Lightning's word for resume=auto
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
        (["ckpt_path=last"], r"resume=auto: no complete checkpoint in .*new/checkpoints; give the folder of the run"),
        (["resume=/nonexistent/run"], r"resume=/nonexistent/run: no complete checkpoint in /nonexistent/run/check"),
        (["ckpt_path=/nonexistent/step-1"], r"ckpt_path=/nonexistent/step-1 does not exist"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 must be >= 1"),
        (["trainer.val_check_interval=0"], r"trainer.val_check_interval=0 must be >= 1"),
        (["checkpoint.keep_last=0"], r"checkpoint.keep_last=0 must be >= 1"),
        (["checkpoint.every_n_steps=0"], r"checkpoint.every_n_steps=0 must be >= 1"),
    ],
)
def test_runs_that_cannot_start_fail_before_launch(overrides: list[str], message: str, tmp_path: Path) -> None:
    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_config([*FAST, *overrides], tmp_path / "new"))


def test_an_unwritable_run_folder_fails_before_any_rank_starts(tmp_path: Path) -> None:
    from lightning_dist.run.train import run

    blocker = tmp_path / "a-file"  # tests run as root here, which permissions do not stop: a file in the path does
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"output_dir=.*a-file/run is not writable \(Not a directory\)"):
        run(compose_config([*FAST, "cluster.devices=1"], blocker / "run"))


def test_a_read_only_checkpoints_folder_fails_before_any_rank_starts(tmp_path: Path) -> None:
    """Found before launch, not at the first save (hours later). ``chattr +i`` makes a folder read-only even for root
    (which these tests run as); where it is not available, a file in its place is as unwritable."""
    import subprocess

    from lightning_dist.run.train import run

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    immutable = subprocess.run(["chattr", "+i", str(checkpoints)], capture_output=True).returncode == 0
    if not immutable:
        checkpoints.rmdir()
        checkpoints.write_text("")
    reason = "Operation not permitted" if immutable else "Not a directory"
    try:
        with pytest.raises(
            ValueError,
            match=rf"^output_dir={tmp_path / 'run'}: its checkpoints folder {checkpoints} is not writable \({reason}\)",
        ):
            run(compose_config([*FAST, "cluster.devices=1", "trainer.enable_checkpointing=true"], tmp_path / "run"))
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(checkpoints)], check=True)


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    """A crash inside the save (here: the writer raises after writing part of it) publishes nothing."""
    dirpath = tmp_path / "checkpoints"
    strategy = SimpleNamespace(barrier=lambda: None, broadcast=lambda value: value)

    def save_checkpoint(path: Path, **kwargs: Any) -> None:
        # DCP's order: the shards, then .metadata; Lightning's file last
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"shard")
        if trainer.global_step == 6:
            raise KeyboardInterrupt  # killed while writing
        (path / ".metadata").write_bytes(b"index")
        (path / checkpoint_metadata_file()).write_bytes(b"loops")

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


RESHARD = [*FAST, "optim.decay_steps=10", "model.n_layers=4"]
LAYOUTS = {
    "one": ["parallelism=fsdp", "cluster.devices=1"],
    "fsdp4": ["parallelism=fsdp", "cluster.devices=4"],
    "pp2-interleaved": [
        "parallelism=pp",
        "cluster.devices=2",
        "parallelism.pipeline.schedule=Interleaved1F1B",
        "parallelism.pipeline.stages_per_rank=2",
    ],
    "pp2xdp2": ["parallelism=pp", "cluster.devices=4"],
    "pp2xtp2": ["parallelism=3d", "cluster.devices=4", "parallelism.dp_shard=1"],
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*RESHARD, *LAYOUTS["one"]], tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize(
    ("written", "read"),
    [("pp2xtp2", "fsdp4"), ("fsdp2", "pp2-interleaved"), ("one", "pp2xdp2"), ("pp2xdp2", "one")],
    ids=str,
)
def test_a_checkpoint_resumes_under_another_layout(
    written: str, read: str, uninterrupted: dict, tmp_path: Path
) -> None:
    """Model, optimizer, LR schedule and data position carry over: the later steps are the uninterrupted ones."""
    first = run_app([*RESHARD, *LAYOUTS[written], "trainer.max_steps=5", "trainer.enable_checkpointing=true"], tmp_path)
    second = run_app([*RESHARD, *LAYOUTS[read], f"ckpt_path={first['checkpoint']}"], tmp_path / "second")
    np.testing.assert_allclose(losses(second), losses(uninterrupted)[5:], rtol=1e-5)


def test_a_damaged_checkpoint_is_one_line_naming_the_newest_whole_one(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    from lightning_dist.checkpoint.export import main as export_main
    from lightning_dist.config.validate import validate

    run_dir = tmp_path / "run"
    saving = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=2", "checkpoint.keep_last=3"]
    run_app([*FAST, "parallelism=ddp", "trainer.max_steps=4", *saving], run_dir)  # Lightning's DDP: single files
    run_app([*FAST, "parallelism=fsdp", "trainer.max_steps=4", *saving], tmp_path / "sharded")
    newest, older = run_dir / "checkpoints" / "step-00000004", run_dir / "checkpoints" / "step-00000002"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, e.g. a full disk
    with pytest.raises(ValueError, match=rf"checkpoint {newest} cannot be loaded \(not a complete torch.save archive"):
        validate(compose_config([*FAST, f"ckpt_path={newest}"], tmp_path / "new"))
    cfg = compose_config([*FAST, "trainer.max_steps=4", f"resume={run_dir}"], tmp_path / "unused")  # its own values
    cfg = validate(cfg).cfg
    assert cfg.ckpt_path == str(older)  # resume skips it and takes the newest whole one
    sharded = tmp_path / "sharded" / "checkpoints" / "step-00000004"
    shard = sharded / "__1_0.distcp"  # rank 1's, hashed by rank 1
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10  # one flipped bit inside a weight: DCP itself would load it silently
    shard.write_bytes(bytes(damaged))
    capfd.readouterr()
    intact = sharded.parent / "step-00000002"
    cfg = validate(
        compose_config([*FAST, "parallelism=fsdp", "trainer.max_steps=4", f"resume={tmp_path / 'sharded'}"])
    ).cfg
    assert cfg.ckpt_path == str(intact)  # walked back to the newest intact one
    assert (
        f"skipped checkpoint {sharded}: __1_0.distcp does not match the CRC-32 written with it (its bytes changed); "
        f"continuing from {intact}\n"
    ) in capfd.readouterr().err
    with pytest.raises(SystemExit) as refused:  # the export of the run folder: its newest checkpoint is damaged
        export_main([str(tmp_path / "sharded"), str(tmp_path / "out.pt")])
    assert str(refused.value.code) == (
        f"lightning-dist-export: checkpoint {sharded} cannot be loaded (__1_0.distcp does not match the CRC-32 "
        f"written with it (its bytes changed)); the newest whole checkpoint there is {intact}."
    )
    assert not (tmp_path / "out.pt").exists()
    (sharded / ".metadata").unlink()  # DCP never finished this one
    with pytest.raises(ValueError, match=r"step-00000004 cannot be loaded \(missing .metadata\); the newest whole"):
        validate(compose_config([*FAST, "parallelism=fsdp", f"ckpt_path={sharded}"], tmp_path / "new2"))


def test_saves_by_wall_time_follow_rank_zeros_clock(tmp_path: Path) -> None:
    decisions = []
    strategy = SimpleNamespace(barrier=lambda: None, broadcast=lambda due: decisions.append(due) or due)
    trainer = SimpleNamespace(global_step=1, is_global_zero=True, strategy=strategy)
    trainer.save_checkpoint = lambda path, **kwargs: (path.mkdir(), (path / ".metadata").touch())
    saver = RunCheckpoints(tmp_path, every_n_minutes=0.5)
    saver.on_train_batch_end(trainer, None)
    assert decisions == [False] and saver.last_path is None  # not yet due
    saver._last_time -= 31  # half a minute later
    trainer.global_step = 2
    saver.on_train_batch_end(trainer, None)
    assert decisions == [False, True] and saver.last_path == tmp_path / "step-00000002"
    steps_only = RunCheckpoints(tmp_path, every_n_steps=10)
    trainer.global_step = 3
    steps_only.on_train_batch_end(trainer, None)
    assert decisions == [False, True]  # no collective per step unless saving by time
