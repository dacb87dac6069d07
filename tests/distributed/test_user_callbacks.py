"""Lightning callbacks from the config (``callbacks=best``, ``+callbacks.<name>._target_=...``): built in each rank
and run by Lightning beside the app's own, under a sharded (FSDP2) layout."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from helpers import FAST, compose_config, run_app

from lightning_dist.config.validate import validate


def test_the_best_checkpoint_and_early_stopping_from_the_config(tmp_path: Path) -> None:
    overrides = [*FAST, "parallelism=fsdp", "callbacks=best", "trainer.max_steps=6", "trainer.val_check_interval=2",
                 "trainer.limit_val_batches=2", "+callbacks.early_stopping.verbose=true", "logger=csv"]  # fmt: skip
    result = run_app(overrides, tmp_path)
    assert result["steps"] == 6  # patience 5: no early stop in 3 validations
    with open(result["csv"]) as file:  # what the logger received
        val = {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(file) if row.get("val/loss")}
    assert len(val) == 3, val
    (best,) = (tmp_path / "best").iterdir()  # save_top_k=1: the other two were removed (sharded folders)
    step = int(re.search(r"step=(\d+)", best.name).group(1))
    lowest = min(val, key=val.get)
    assert step == lowest + 1, (best.name, val)  # Lightning names a checkpoint by the steps done


def test_a_callback_without_a_target_stops_before_launch() -> None:
    with pytest.raises(ValueError, match=r"^callbacks\.stop has no _target_"):
        validate(compose_config([*FAST, "+callbacks.stop.monitor=val/loss"]))
