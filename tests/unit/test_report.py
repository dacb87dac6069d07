"""The run report from small synthetic ``report.json`` files: the loss against tokens seen, and several runs overlaid
(``lightning-dist-report RUN_DIR --compare OTHER ...``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_dist.telemetry import report


def _run(folder: Path, steps: int, slope: float, telemetry: bool, **extra: Any) -> Path:
    """A finished run's ``report.json``: its loss falls by ``slope`` a step, val/loss every 10 steps; with
    ``telemetry`` every 5th step logged 4096 tokens per step (2048 tokens/s x 2000 ms), else only ``extra``."""
    history = []
    for step in range(1, steps + 1):
        record: dict[str, float] = {"step": float(step), "train/loss": 3.0 - slope * step}
        if telemetry and step % 5 == 0:
            record.update({"perf/tokens_per_sec": 2048.0, "perf/step_ms": 2000.0, "comm/dp/bytes": 100.0})
        if step % 10 == 0:
            record["val/loss"] = 3.1 - slope * step
        history.append(record)
    folder.mkdir()
    data = {"output_dir": str(folder), "layout": "ddp (world 2)", "steps": steps, "loss_floor": 1.5,
            "val_loss": history[-1]["val/loss"], "history": history, **extra}  # fmt: skip
    (folder / "report.json").write_text(json.dumps(data))
    return folder


@pytest.fixture
def axes_of(monkeypatch) -> dict[str, list[tuple[str, str]]]:
    """Each saved figure's axes' (x label, title), a secondary axis after its parent (with its title), by file."""
    seen: dict[str, list[tuple[str, str]]] = {}
    save = report._save

    def spy(fig, path: Path) -> str:
        seen[path.name] = [(a.xaxis.get_label_text(), ax.get_title()) for ax in fig.axes for a in (ax, *ax.child_axes)]
        return save(fig, path)

    monkeypatch.setattr(report, "_save", spy)
    return seen


def test_the_report_plots_loss_against_tokens_seen(tmp_path, axes_of) -> None:
    counted = _run(tmp_path / "counted", 40, 0.01, telemetry=True)  # tokens per step from the telemetry
    report.main([str(counted)])
    assert axes_of["loss.png"] == [("tokens seen (M)", "Loss"), ("optimizer step", "Loss")]  # the steps on the top edge
    page = (counted / "report.html").read_text()
    assert "<th>tokens per step</th><td>4,096</td>" in page and "<th>tokens seen</th><td>163,840</td>" in page
    told = _run(tmp_path / "told", 20, 0.01, telemetry=False, tokens_per_step=1024)  # the app's count, no telemetry
    report.main([str(told)])
    assert "<th>tokens seen</th><td>20,480</td>" in (told / "report.html").read_text()


def test_compare_overlays_runs_at_the_same_tokens(tmp_path, axes_of) -> None:
    sync = _run(tmp_path / "sync", 40, 0.01, telemetry=True)  # 4096 tokens a step, counted
    half = _run(tmp_path / "half", 80, 0.005, telemetry=False, tokens_per_step=2048)  # the same tokens in 2x the steps
    report.main([str(sync), "--compare", str(half), "--out", str(tmp_path / "both")])
    val, train = axes_of["compare_loss.png"]
    assert val == ("tokens seen (M)", "val/loss") and train == ("tokens seen (M)", "train/loss, 1-step mean")
    page = (tmp_path / "both" / "compare.html").read_text()
    assert page.count("<img ") == 1 and "data:image/png;base64," in page
    rows = [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", page)]
    head, first, second = rows
    # val/loss every 40,960 tokens (sync) and every 20,480 (half): one column per token count, "-" where not logged
    assert head[3:11] == [f"{m}M tok" for m in ("0.0205", "0.041", "0.0614", "0.0819", "0.102", "0.123", "0.143",
                                                "0.164")]  # fmt: skip
    assert first[:11] == ["sync", "ddp (world 2)", "163,840", "-", "3.0000", "-", "2.9000", "-", "2.8000", "-",
                          "2.7000"]  # fmt: skip
    assert second[3:11] == ["3.0500", "3.0000", "2.9500", "2.9000", "2.8500", "2.8000", "2.7500", "2.7000"]
    assert head[12] == "vs sync" and first[12:14] == second[12:14] == ["+0.0000", "+1.2000"]  # to sync, to the floor
    assert first[-3] == "100" and second[-3] == "-"  # comm/dp bytes per step: the median of what was logged
