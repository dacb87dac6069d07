"""Shared test setup: CPU only, W&B offline, quiet logs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")


@pytest.fixture(autouse=True)
def _no_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without the rank variables an earlier test's in-process Lightning run left in this worker
    (``MASTER_PORT`` among them, whose port that run's store may still hold): a job the test starts in a child
    process (submitit's tasks, a benchmark) would otherwise take them and fail to listen there (EADDRINUSE)."""
    from helpers import LAUNCH_VARS

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Seconds spent per tier (setup, call and teardown together: spawned process groups live in fixtures)."""
    tiers: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, duration = getattr(report, "nodeid", ""), getattr(report, "duration", None)
            if not nodeid or duration is None:
                continue
            parts = nodeid.split("::")[0].split("/")
            tier = parts[1] if len(parts) > 2 else parts[-1]  # tests/unit/x.py -> unit; tests/test_app.py
            tiers[tier] = tiers.get(tier, 0.0) + duration
    if tiers:
        terminalreporter.write_sep("=", "time per tier")
        for tier, seconds in sorted(tiers.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:8.1f} s  {tier}")
