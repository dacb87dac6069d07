"""The ``trainer`` group is Lightning's ``Trainer`` arguments: typed where the run reads them, passed through otherwise.

Checked: every ``Trainer`` argument is known (against the installed Lightning), an unknown, moved or app-owned key is
one line naming the fix, Lightning's names for ``cluster.*`` set those, and a run really receives what was passed.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers import FAST, compose_config, run_app

from lightning_dist.config.trainer_args import LIGHTNING_TRAINER_ARGS, MOVED
from lightning_dist.config.validate import validate


def test_the_list_of_trainer_arguments_is_lightnings():
    """The launcher checks keys against a list (it does not import Lightning): the list must be Lightning's own."""
    assert set(LIGHTNING_TRAINER_ARGS) == set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}


def test_any_trainer_argument_passes_through_and_the_run_fields_are_typed():
    cfg = compose_config(["+trainer.profiler=simple", "+trainer.deterministic=true", "trainer.max_epochs=3"])
    assert cfg.trainer.extra == {"profiler": "simple", "deterministic": True}
    assert cfg.trainer.max_epochs == 3 and cfg.trainer.max_steps == 300
    with pytest.raises(ValueError, match=r"^trainer.max_steps: Value 'many' .* could not be converted to Integer"):
        compose_config(["trainer.max_steps=many"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+trainer.max_epoch=2", r"^trainer.max_epoch is not an argument of lightning.Trainer; did you mean "
                                 r"trainer.max_epochs\?"),
        ("+trainer.strategy=ddp", r"^trainer.strategy is set by the app: the layout is parallelism="),
        ("+trainer.logger=false", r"^trainer.logger is set by the app: use logger=wandb\|csv\|tensorboard"),
        ("+trainer.hang_timeout_s=5", r"^trainer.hang_timeout_s is not a Trainer argument and moved: use "
                                      r"resilience.hang_timeout_s=5"),
        ("+trainer.telemetry=false", r"^trainer.telemetry .* use telemetry.enabled=False"),
        # Lightning 1's names: where the value goes now, not a source file to read
        ("+trainer.gpus=2", r"^trainer.gpus is Lightning 1's; use cluster=gpu cluster.devices=2 \(Lightning 2 counts"),
        ("+trainer.num_processes=4", r"^trainer.num_processes is Lightning 1's; use cluster.devices=4\.$"),
        ("+trainer.resume_from_checkpoint=x.ckpt", r"^trainer.resume_from_checkpoint .* or ckpt_path=x.ckpt\.$"),
    ],
)  # fmt: skip
def test_a_key_the_trainer_does_not_take_is_one_line(override, message):
    with pytest.raises(ValueError, match=message):
        compose_config([override])


def test_lightning_1s_gpus_on_the_command_line_points_to_cluster_devices(monkeypatch, capfd):
    """``trainer.gpus=2`` pointed to a source file listing the Trainer's arguments."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_dist.run.train import main

    GlobalHydra.instance().clear()  # compose_config's, from the tests before: the app initializes its own
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "trainer.gpus=2"])
    with pytest.raises(SystemExit):
        main()
    assert capfd.readouterr().err.strip() == (
        "error: trainer.gpus is Lightning 1's; use cluster=gpu cluster.devices=2 (Lightning 2 counts them with "
        "devices=)."
    )


def test_a_moved_setting_on_the_command_line_says_where_it_went(monkeypatch):
    """``trainer.report=false`` (no ``+``) would fail inside Hydra as "not in struct mode"; the app names the move."""
    from lightning_dist.run.train import main

    assert set(MOVED.values()) >= {"telemetry.report", "resilience.max_restarts"}
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "trainer.report=false"])
    with pytest.raises(SystemExit, match=r"^trainer.report moved out of trainer. .*: use telemetry.report=false$"):
        main()


def test_lightning_names_for_the_cluster_fields_set_them():
    cfg = compose_config(["trainer.devices=1", "trainer.precision=bf16-true", "trainer.accelerator=cpu"])
    valid = validate(cfg)
    assert (valid.cfg.cluster.devices, valid.cfg.cluster.precision, valid.dims.world_size) == (1, "bf16-true", 1)
    assert cfg.cluster.devices == 2  # the input is not changed


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=0", r"^trainer.max_steps=0 must be >= 1, or -1"),
        ("trainer.max_steps=-1", r"^trainer.max_steps=-1 needs trainer.max_epochs=<n>"),
        ("trainer.val_check_interval=1.5", r"^trainer.val_check_interval=1.5 must be a fraction in \(0, 1\]"),
        ("trainer.val_check_interval=often", r"^trainer.val_check_interval='often' must be a count"),
    ],
)
def test_trainer_values_out_of_range_are_one_line(override, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_config([override]))


@pytest.fixture
def quiet_env(monkeypatch, tmp_path):
    """Lightning and the launcher write MASTER_ADDR / PORT and W&B variables: keep them out of later tests."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, "")) if name in os.environ else monkeypatch.delenv(name, False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


ONE_RANK = [o for o in FAST if not o.startswith("logger=")] + ["trainer.devices=1"]


def test_the_run_receives_what_was_passed(tmp_path: Path, quiet_env):
    """By epochs, with a pass-through batch limit and a profiler built from ``_target_`` (its report is a file: the
    ranks' stdout is not this test's): 1 epoch of 3 batches."""
    profiler = "+trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiler"
    overrides = [*ONE_RANK, "logger=none", "trainer.max_steps=-1", "trainer.max_epochs=1",
                 "+trainer.limit_train_batches=3", profiler, f"+trainer.profiler.dirpath={tmp_path / 'prof'}",
                 "+trainer.profiler.filename=simple"]  # fmt: skip
    result = run_app(overrides, tmp_path / "epochs")
    assert result.steps == 3
    report = (tmp_path / "prof" / "fit-simple.txt").read_text()
    assert "FIT Profiler Report" in report and "run_training_batch" in report


def test_fast_dev_run_saves_and_logs_nothing(tmp_path: Path, quiet_env):
    result = run_app([*ONE_RANK, "logger=wandb", "trainer.enable_checkpointing=true", "trainer.fast_dev_run=true"],
                     tmp_path / "smoke")  # fmt: skip
    assert result.steps == 1
    assert sorted(p.name for p in (tmp_path / "smoke").iterdir() if p.name in ("checkpoints", "wandb")) == []
