"""Restarts are decided by the failing rank's exception class (``lightning_dist.errors``), never by its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST, compose_config

from lightning_dist.errors import LightningDistError, NonFiniteError, restart_would_repeat
from lightning_dist.run import train
from lightning_dist.run.launch import RankFailedError


class BadPath(ValueError):
    """A bad value found on a rank whose class name does not start with "ValueError"."""


class Transient(LightningDistError):
    """One of ours that a restart may well get past."""


def test_which_exception_classes_a_restart_would_repeat() -> None:
    assert restart_would_repeat(NonFiniteError) and restart_would_repeat(ValueError)
    assert restart_would_repeat(BadPath) and restart_would_repeat(json.JSONDecodeError)  # subclasses of ValueError
    for transient in (RuntimeError, ConnectionError, FileNotFoundError, OSError, KeyboardInterrupt, Transient):
        assert not restart_would_repeat(transient), transient
    from lightning_dist.parallel.guard import NonFiniteError as from_guard

    assert from_guard is NonFiniteError and issubclass(NonFiniteError, RuntimeError)  # still caught as before


def _restarts(failure: RankFailedError, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many times ``_launch_with_restarts`` (``max_restarts=2``) started the ranks when each start fails so."""
    from lightning_dist.config.validate import validate

    tmp_path.mkdir()
    valid = validate(compose_config([*FAST, "resilience.max_restarts=2"], tmp_path))
    starts = []

    def launch(fn, nprocs, run):
        starts.append(run.cfg.ckpt_path)
        raise failure

    monkeypatch.setattr(train, "launch", launch)
    with pytest.raises(RankFailedError) as err:
        train._launch_with_restarts(valid)
    assert err.value is failure
    return len(starts) - 1


def test_a_failure_is_restarted_by_the_class_the_rank_reported_not_by_its_message(tmp_path, monkeypatch) -> None:
    # A ValueError subclass: its one-line message starts with its own name, which no message prefix would have caught.
    repeating = RankFailedError(1, "BadPath: data.path='x' matched no file", kind="raised",
                                exc_type=f"{__name__}.BadPath", will_repeat=True)  # fmt: skip
    assert _restarts(repeating, tmp_path / "a", monkeypatch) == 0
    # A message that only looks like a ValueError's: the class the rank reported is what counts.
    transient = RankFailedError(0, "ValueError-like text from a RuntimeError", kind="raised",
                                exc_type="builtins.RuntimeError", will_repeat=False)  # fmt: skip
    assert _restarts(transient, tmp_path / "b", monkeypatch) == 2
    assert _restarts(RankFailedError(1, "died (exit code 3)"), tmp_path / "c", monkeypatch) == 2
