"""The ``debug`` group: fdr, overfit, profile (a Chrome trace of chosen steps) and memory (CUDA snapshots)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import FAST, compose_config, run_app

from lightning_dist.config.validate import validate

ONE_RANK = [o for o in FAST if not o.startswith("logger=")] + ["logger=none", "trainer.devices=1"]


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, os.environ.get(name, "")) if name in os.environ else monkeypatch.delenv(name, False)


def test_fdr_and_overfit_set_lightnings_own_switches() -> None:
    assert compose_config(["debug=fdr"]).trainer.fast_dev_run is True
    overfit = compose_config(["debug=overfit"]).trainer
    assert overfit.extra == {"overfit_batches": 4} and overfit.max_steps == 200


def test_profile_writes_a_chrome_trace_of_the_chosen_steps(tmp_path: Path, quiet_env) -> None:
    steps = ["debug=profile", "debug.profile_from=2", "debug.profile_to=3", "trainer.max_steps=4"]
    result = run_app([*ONE_RANK, *steps], tmp_path / "run")
    trace = tmp_path / "run" / "profile" / "rank0_steps2-3.json"
    assert result.logs["profile trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome's trace format: what Perfetto opens
    names = {event.get("name", "") for event in events}
    assert any(name.startswith("aten::addmm") or name.startswith("aten::mm") for name in names)  # the model's matmuls
    assert "[memory]" in names  # allocations: the CPU profiler's memory view
    assert sum(name.startswith("Optimizer.step#AdamW") for name in names) >= 1
    steps_traced = [e for e in events if str(e.get("name", "")).startswith("Optimizer.step#AdamW.step")]
    assert len(steps_traced) == 2  # steps 2 and 3, not 1 or 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["debug=memory"],
            r"^debug=memory records CUDA memory history; cluster.accelerator=cpu has none: use debug=pr",
        ),
        (["debug=profile", "trainer.max_steps=5", "debug.profile_to=8"], r"^debug.profile_to=8 is past trainer.max_s"),
        (["debug=profile", "debug.profile_from=4", "debug.profile_to=3"], r"^debug.profile_from=4, profile_to=3: need"),
    ],
)
def test_a_debug_setting_that_cannot_work_is_one_line_before_launch(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(compose_config(overrides))


def test_memory_snapshots_at_the_end_and_on_out_of_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback's part without a GPU (its torch calls recorded); tests/gpu/test_gpu.py runs it on CUDA."""
    import torch

    from lightning_dist import _compat
    from lightning_dist.callbacks.debug import CudaMemoryHistory

    dumped: list[str] = []
    monkeypatch.setattr(_compat, "dump_cuda_memory_snapshot", dumped.append)
    history = CudaMemoryHistory(tmp_path / "memory")
    trainer = SimpleNamespace(global_rank=3)
    history.on_exception(trainer, None, RuntimeError("not memory"))
    assert dumped == []
    history.on_exception(trainer, None, torch.OutOfMemoryError("CUDA out of memory"))
    history.on_train_end(trainer, None)
    assert dumped == [str(tmp_path / "memory" / "rank3_oom.pickle"), str(tmp_path / "memory" / "rank3_end.pickle")]
