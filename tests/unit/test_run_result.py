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


def test_a_run_that_did_not_train_fails_in_one_line(capfd: pytest.CaptureFixture) -> None:
    """resilience.on_nonfinite=skip trains on past non-finite steps: ending on a NaN loss, or with most updates
    dropped, is no trained model; a few dropped updates are said in one line."""
    from lightning_dist.errors import DivergedError
    from lightning_dist.run.train import check_trained

    nan = float("nan")

    def run(*steps: tuple[float, float]) -> RunResult:
        history = [{"step": i + 1, "train/loss": loss, "train/grad_norm": norm} for i, (loss, norm) in enumerate(steps)]
        return RunResult(output_dir="/runs/a", layout="-", steps=len(steps), history=history, checkpoint="/runs/a/c/s")

    with pytest.raises(DivergedError) as failed:
        check_trained(run((3.0, 1.0), (nan, nan), (nan, nan)), "skip")
    assert str(failed.value) == (
        "train/loss is nan at the end (step 3): 2 of the 3 logged steps had a non-finite loss, 2 a non-finite gradient "
        "norm (resilience.on_nonfinite=skip: their updates dropped), so the weights in /runs/a/c/s are not a trained "
        "model's; lower optim.lr or raise optim.warmup_steps, or set resilience.on_nonfinite=stop to end at the first "
        "such step."
    )
    with pytest.raises(DivergedError) as failed:  # the probe's case here: a finite loss, most updates dropped
        check_trained(run((5.5, 1.0), (5.5, 0.0), (5.5, nan), (5.5, nan), (5.5, nan)), "skip")
    assert str(failed.value).startswith(
        "resilience.on_nonfinite=skip dropped the updates of 3 of the 5 logged steps (a non-finite gradient norm; the "
        "last at step 5), so the run did not train (train/loss 5.5 at the end) and the weights in /runs/a/c/s are not"
    )
    capfd.readouterr()
    check_trained(run((3.0, 1.0), (3.0, nan), (2.0, 1.0), (1.5, 1.0)), "skip")  # one dropped: said, and fine
    assert (
        capfd.readouterr()
        .err.strip()
        .endswith(
            "note: resilience.on_nonfinite=skip dropped the updates of 1 of the 4 logged steps (a non-finite gradient "
            "norm; the last at step 2)"
        )
    )
    check_trained(_result(), "skip")  # a finite loss, no norms logged
    check_trained(RunResult(output_dir="/runs/b", layout="-", steps=3, train_loss=nan), "skip")  # none logged
