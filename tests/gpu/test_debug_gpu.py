"""debug=memory and debug=profile on one CUDA device: the snapshot memory_viz opens, the trace with CUDA kernels."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from helpers import FAST, run_app

pytestmark = pytest.mark.gpu


def test_memory_history_snapshot_at_the_end(tmp_path: Path) -> None:
    run_app([*FAST, "cluster=gpu", "debug=memory", "trainer.max_steps=3"], tmp_path)
    snapshot = pickle.loads((tmp_path / "memory" / "rank0_end.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # allocator state and the recorded history


def test_profile_trace_has_cuda_kernels(tmp_path: Path) -> None:
    run_app([*FAST, "cluster=gpu", "debug=profile", "debug.profile_from=2", "debug.profile_to=3"], tmp_path)
    events = json.loads((tmp_path / "profile" / "rank0_steps2-3.json").read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
