"""The non-finite guard: a step whose gradient norm is NaN / Inf is never applied, on every strategy.

``optim.lr=1e3`` blows the weights up within ~10 steps (before: NaN losses from step 6, a NaN checkpoint, exit 0).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import FAST, run_app

from lightning_dist.checkpoint.store import latest_checkpoint
from lightning_dist.errors import DivergedError
from lightning_dist.run.launch import RankFailedError

DIVERGING = ["optim.lr=1e3", "trainer.max_steps=30", "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=2"]


@pytest.mark.parametrize("layout", [["parallelism=fsdp"], ["parallelism=ddp"]], ids=["fsdp2", "ddp2"])
def test_a_diverging_run_stops_at_the_first_nonfinite_step(layout: list[str], tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match=r"NonFiniteError: step \d+: gradient norm nan .* is not finite") as err:
        run_app([*FAST, *DIVERGING, *layout], tmp_path)
    assert err.value.exc_type == "lightning_dist.errors.NonFiniteError" and err.value.will_repeat  # not restarted
    failed_step = int(re.search(r"step (\d+):", str(err.value)).group(1))
    assert failed_step < 30
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and int(latest.name.removeprefix("step-")) < failed_step  # nothing of it saved


def test_skip_drops_the_updates_and_trains_to_the_end_but_a_run_that_did_not_train_fails(tmp_path: Path) -> None:
    """The probe: on_nonfinite=skip dropped 7 of 10 updates and exited 0 with ``train/loss : nan``. Here (lr 1e3) it
    drops most of 30 (the loss stuck at ln 256 from step 4): the run goes to its end and saves, then fails in one line
    saying why."""
    with pytest.raises(DivergedError) as failed:
        run_app([*FAST, *DIVERGING, "parallelism=fsdp", "resilience.on_nonfinite=skip"], tmp_path)
    message = str(failed.value)
    said = r"resilience.on_nonfinite=skip dropped the updates of \d+ of the 30 logged steps \(a non-finite gradient "
    assert re.match(said + r"norm; the last at step 30\), so the run did not train", message), message
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000030"
    assert "\n" not in message


def test_an_unknown_action_fails_before_launch() -> None:
    from helpers import compose_config

    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"resilience.on_nonfinite='ignore' is unknown; use stop"):
        validate(compose_config([*FAST, "resilience.on_nonfinite=ignore"]))
