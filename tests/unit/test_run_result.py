"""``RunResult``: the typed summary ``fit()`` / ``run()`` / ``slurm.submit()`` return, with dict-style reads kept."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields

import pytest
from helpers import losses

from lightning_dist.run.result import RunResult


def _result() -> RunResult:
    return RunResult(
        output_dir="/runs/a", layout="fsdp: pp=1 dp_replicate=1 dp_shard=2 tp=1 (world 2)", steps=3, train_loss=2.5,
        history=[{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 2.5}], checkpoint_blocked_s=[0.1],
    )  # fmt: skip


def test_fields_round_trip_through_to_dict_json_and_pickle() -> None:
    result = _result()
    plain = result.to_dict()
    assert list(plain) == [f.name for f in fields(RunResult)]
    assert {"output_dir", "layout", "steps", "history", "wall_time_s", "ranks", "prediction", "hardware", "report",
            "job_id", "dry_run", "preempted", "checkpoint", "rank_layouts"} <= set(plain)  # fmt: skip
    assert RunResult.from_dict(plain) == result
    assert RunResult.from_dict(json.loads(json.dumps(plain))) == result
    assert pickle.loads(pickle.dumps(result)) == result
    with pytest.raises(TypeError):
        RunResult.from_dict({**plain, "not_a_field": 1})


def test_dict_style_reads_for_compatibility() -> None:
    result = _result()
    assert result["steps"] == 3 and result["val_loss"] is None
    assert result.get("val_loss") is None and result.get("val_loss", 7.0) == 7.0 and result.get("steps", 0) == 3
    assert "steps" in result and "prediction" not in result and "nonsense" not in result  # set means not None
    with pytest.raises(KeyError):
        result["nonsense"]
    assert losses(result) == [3.0, 2.5]


def test_a_submission_that_did_not_run_here_has_no_steps() -> None:
    submitted = RunResult(output_dir="/runs/b", layout="ddp", job_id="4242")
    assert submitted.steps is None and "steps" not in submitted and not submitted.dry_run and submitted.history == []


def test_a_run_whose_last_loss_is_not_finite_fails_in_one_line() -> None:
    """resilience.on_nonfinite=skip trains on past non-finite steps; ending on a NaN loss is no trained model."""
    from lightning_dist.errors import DivergedError
    from lightning_dist.run.train import check_trained

    nan = float("nan")
    history = [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": nan}, {"step": 3, "train/loss": nan}]
    diverged = RunResult(output_dir="/runs/a", layout="-", steps=3, history=history, checkpoint="/runs/a/c/step-3")
    with pytest.raises(DivergedError) as failed:
        check_trained(diverged, "skip")
    assert str(failed.value) == (
        "train/loss is nan at the end (step 3): 2 of the 3 logged steps had a non-finite loss "
        "(resilience.on_nonfinite=skip dropped their updates and went on), so the weights in /runs/a/c/step-3 are not "
        "a trained model's; lower optim.lr or raise optim.warmup_steps, or set resilience.on_nonfinite=stop to end at "
        "the first such step."
    )
    check_trained(_result(), "skip")  # a finite last loss
    check_trained(RunResult(output_dir="/runs/b", layout="-", steps=3, train_loss=nan), "skip")  # none logged
    recovered = [*history, {"step": 4, "train/loss": 2.0}]  # a skipped step in the middle, a finite end: fine
    check_trained(RunResult(output_dir="/runs/a", layout="-", steps=4, history=recovered), "skip")
