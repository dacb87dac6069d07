"""The run report: one self-contained HTML page (its PNGs embedded, and beside it) in the run folder.

Written at the end of every run from ``report.json`` (the summary rank 0 returns), and again with
``lightning-dist-report RUN_DIR``. It shows the loss curve against the data's loss floor; where a step's time went
(data loading, communication per mesh axis, pipeline bubble, the rest being compute), as the telemetry logged it;
tokens/s and memory over the run; which rank holds which pipeline stage and shard; and the planner's estimate for
this layout next to what was measured. Plots: matplotlib (Agg, no display needed).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lightning_dist.parallel_dims import REPORTED_AXES

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
AXES = REPORTED_AXES  # comm/<axis>/ms as the telemetry logs it


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Store what the report needs (JSON-safe parts of the run's summary) as ``report.json``."""
    keep = ("output_dir", "layout", "steps", "train_loss", "val_loss", "loss_floor", "history", "wall_time_s",
            "ranks", "rank_layouts", "prediction", "hardware")  # fmt: skip
    path = Path(run_dir) / REPORT_JSON
    path.write_text(json.dumps({k: summary[k] for k in keep if k in summary}, indent=1, default=str) + "\n")
    return path


def render(run_dir: Path) -> Path:
    """Write ``report.html`` and its PNGs in ``run_dir`` from its ``report.json``; returns the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    data = json.loads((run_dir / REPORT_JSON).read_text())
    history = data.get("history", [])
    steps = [int(r["step"]) for r in history]
    figures: list[tuple[str, str]] = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r.get("train/loss") for r in history], label="train/loss")
    if data.get("loss_floor") is not None:
        ax.axhline(data["loss_floor"], color="grey", linestyle="--", label=f"loss floor {data['loss_floor']:.3f}")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)", title="Loss")
    ax.legend()
    figures.append(("loss.png", _save(fig, run_dir / "loss.png")))

    parts = time_split(history)
    if parts:
        fig, ax = plt.subplots(figsize=(7, 2.2))
        left = 0.0
        for name, ms in parts.items():
            ax.barh([0], [ms], left=left, label=f"{name} {ms:.1f} ms")
            left += ms
        ax.set(yticks=[], xlabel="ms per step (median of the logged steps)", title="Where a step's time went")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.45))
        figures.append(("step_time.png", _save(fig, run_dir / "step_time.png")))

    series = {k: [(s, r[k]) for s, r in zip(steps, history) if k in r]
              for k in ("perf/tokens_per_sec", "memory/peak_allocated_gib", "memory/rss_gib")}  # fmt: skip
    if any(series.values()):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
        for key, points in series.items():
            if points:
                (bottom if key.startswith("memory") else top).plot(*zip(*points), label=key)
        top.set(ylabel="tokens/s", title="Throughput and memory")
        bottom.set(xlabel="optimizer step", ylabel="GiB per rank")
        bottom.legend(fontsize=8)
        figures.append(("throughput_memory.png", _save(fig, run_dir / "throughput_memory.png")))
    plt.close("all")

    page = run_dir / REPORT_HTML
    page.write_text(_html(data, parts, figures))
    return page


def time_split(history: list[dict[str, float]]) -> dict[str, float]:
    """Median ms per step: data loading, communication per axis, pipeline bubble, and the rest (compute)."""
    logged = [r for r in history if "perf/step_ms" in r]
    if not logged:
        return {}
    step = statistics.median(r["perf/step_ms"] for r in logged)
    parts = {"data loading": statistics.median(r.get("perf/data_ms", 0.0) for r in logged)}
    for axis in AXES:
        key = f"comm/{axis}/ms"
        if any(key in r for r in logged):
            parts[f"comm {axis}"] = statistics.median(r.get(key, 0.0) for r in logged)
    if any("pipeline/bubble_fraction" in r for r in logged):
        parts["pipeline bubble"] = step * statistics.median(r.get("pipeline/bubble_fraction", 0.0) for r in logged)
    parts["compute (the rest)"] = max(0.0, step - sum(parts.values()))
    return parts


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return base64.b64encode(path.read_bytes()).decode()


def _html(data: dict[str, Any], parts: dict[str, float], figures: list[tuple[str, str]]) -> str:
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in (
        ("run folder", data.get("output_dir")), ("layout", data.get("layout")), ("steps", data.get("steps")),
        ("wall time s", round(data.get("wall_time_s") or 0, 1)), ("final train/loss", data.get("train_loss")),
        ("val/loss", data.get("val_loss")), ("loss floor", data.get("loss_floor"))))  # fmt: skip
    images = "".join(f'<h2>{esc(name)}</h2><img alt="{esc(name)}" src="data:image/png;base64,{b64}">'
                     for name, b64 in figures)  # fmt: skip
    ranks = data.get("ranks") or []
    layout = ""
    if ranks:
        cols = list(ranks[0])
        head = "".join(f"<th>{esc(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{esc(str(r[c]))}</td>" for c in cols) + "</tr>" for r in ranks)
        layout = f"<h2>Which rank holds what</h2><table><tr>{head}</tr>{body}</table>"
    prediction = ""
    if data.get("prediction"):
        pred = data["prediction"]
        body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(p))}</td><td>{esc(str(m))}</td></tr>"
                       for k, (p, m) in pred.items())  # fmt: skip
        prediction = (f"<h2>Planner estimate for this layout ({esc(str(data.get('hardware')))}) and measured</h2>"
                      f"<table><tr><th></th><th>predicted</th><th>measured</th></tr>{body}</table>")  # fmt: skip
    split = "".join(f"<tr><th>{esc(k)}</th><td>{v:.2f}</td></tr>" for k, v in parts.items())
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>lightning-dist run report</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}td,th{padding:2px 8px;text-align:left}"
        "img{max-width:100%}</style></head><body><h1>Run report</h1>"
        f"<table>{rows}</table>{images}<h2>Step time (ms, median)</h2><table>{split}</table>{layout}{prediction}"
        "</body></html>\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-report", description="(Re)write a run folder's report.")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if not (args.run_dir / REPORT_JSON).is_file():
        sys.exit(f"lightning-dist-report: {args.run_dir} has no {REPORT_JSON}; give the folder of a finished run.")
    print(render(args.run_dir))


if __name__ == "__main__":
    main()
