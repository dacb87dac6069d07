"""The run report: one self-contained HTML page (its PNGs embedded, and beside it) in the run folder.

Written at the end of every run from ``report.json`` (the summary rank 0 returns), and again with
``lightning-dist-report RUN_DIR``. It shows the loss curve against tokens seen (and optimizer steps) and the data's
loss floor; where a step's time went (data loading, communication per mesh axis, pipeline bubble, the rest being
compute), as the telemetry logged it; tokens/s and memory over the run; which rank holds which pipeline stage and
shard; and the planner's estimate for this layout next to what was measured. Plots: matplotlib (Agg, no display
needed).

``lightning-dist-report RUN_DIR --compare OTHER_RUN_DIR ...`` (:func:`render_comparison`) writes ``compare.html``
instead: the runs' loss curves overlaid against tokens seen, with the loss floor, and a table of the loss at the same
tokens (``benchmarks/diloco_quality.py`` writes its sync / DiLoCo / streaming / int8 comparison so).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dist.parallel_dims import REPORTED_AXES

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
COMPARE_HTML = "compare.html"
AXES = REPORTED_AXES  # comm/<axis>/ms as the telemetry logs it


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Store what the report needs (JSON-safe parts of the run's summary) as ``report.json``."""
    keep = (
        "output_dir",
        "layout",
        "devices",
        "steps",
        "train_loss",
        "val_loss",
        "loss_floor",
        "history",
        "wall_time_s",
        "ranks",
        "rank_layouts",
        "prediction",
        "hardware",
        "tokens_per_step",
    )
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
    per_step = tokens_per_step(data)
    for key, points in loss_curves(data).items():
        ax.plot(*zip(*points), **({"marker": "o", "linestyle": "none"} if key == "val/loss" else {}), label=key)
    _floors(ax, [data])
    ax.set(xlabel=_x_label(per_step), ylabel="loss (nats/token)", title="Loss")
    if per_step:  # the optimizer steps on the top edge
        top = ax.secondary_xaxis("top", functions=(lambda m: m * 1e6 / per_step, lambda s: s * per_step / 1e6))
        top.set_xlabel("optimizer step")
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

    series = {
        k: [(s, r[k]) for s, r in zip(steps, history) if k in r]
        for k in ("perf/tokens_per_sec", "memory/peak_allocated_gib", "memory/rss_gib")
    }
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


def tokens_per_step(data: dict[str, Any]) -> float | None:
    """Tokens per optimizer step over all ranks: the run's ``data.global_batch_size x data.seq_len`` (``report.json``'s
    ``tokens_per_step``), else what the telemetry counted (``perf/tokens_per_sec`` x ``perf/step_ms`` of a logging
    window, the median over them); None without either."""
    if data.get("tokens_per_step"):
        return float(data["tokens_per_step"])
    counted = [
        r["perf/tokens_per_sec"] * r["perf/step_ms"] / 1e3
        for r in data.get("history", [])
        if "perf/tokens_per_sec" in r and "perf/step_ms" in r
    ]
    return round(statistics.median(counted), 3) if counted else None


def loss_curves(data: dict[str, Any], window: int = 1, tokens: bool = True) -> dict[str, list[tuple]]:
    """``{"train/loss": [(x, loss), ...], "val/loss": [...]}`` from a run's history (keys it logged only): x is the
    tokens seen in millions (optimizer steps without a tokens count, or with ``tokens=False``); train/loss is the mean
    of the ``window`` steps up to each point."""
    per_step = tokens_per_step(data) if tokens else None
    scale = per_step / 1e6 if per_step else 1.0
    curves: dict[str, list[tuple]] = {}
    train = [(r["step"], r["train/loss"]) for r in data.get("history", []) if r.get("train/loss") is not None]
    if len(train) >= window:
        losses = [loss for _, loss in train]
        curves["train/loss"] = [
            (step * scale, sum(losses[i + 1 - window : i + 1]) / window)
            for i, (step, _) in enumerate(train)
            if i + 1 >= window
        ]
    val = [(r["step"] * scale, r["val/loss"]) for r in data.get("history", []) if r.get("val/loss") is not None]
    if val:
        curves["val/loss"] = val
    return curves


def _tokens_seen(data: dict[str, Any]) -> float | None:
    per_step = tokens_per_step(data)
    return per_step * data["steps"] if per_step and data.get("steps") is not None else None


def _count(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"


def _x_label(in_tokens: Any) -> str:
    return "tokens seen (M)" if in_tokens else "optimizer step (no tokens count)"


def _floors(ax: Any, runs: list[dict[str, Any]]) -> None:
    """A dashed line at each distinct loss floor of ``runs``."""
    for floor in sorted({r["loss_floor"] for r in runs if r.get("loss_floor") is not None}):
        ax.axhline(floor, color="grey", linestyle="--", label=f"loss floor {floor:.4f}")


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
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>"
        for k, v in (
            ("run folder", data.get("output_dir")),
            ("layout", data.get("layout")),
            ("steps", data.get("steps")),
            ("tokens per step", _count(tokens_per_step(data))),
            ("tokens seen", _count(_tokens_seen(data))),
            ("wall time s", round(data.get("wall_time_s") or 0, 1)),
            ("final train/loss", data.get("train_loss")),
            ("val/loss", data.get("val_loss")),
            ("loss floor", data.get("loss_floor")),
            *_replica_rows(data.get("history") or []),
        )
    )
    images = "".join(
        f'<h2>{esc(name)}</h2><img alt="{esc(name)}" src="data:image/png;base64,{b64}">' for name, b64 in figures
    )
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
        body = "".join(
            f"<tr><th>{esc(k)}</th><td>{esc(str(p))}</td><td>{esc(str(m))}</td></tr>" for k, (p, m) in pred.items()
        )
        prediction = (
            f"<h2>Planner estimate for this layout ({esc(str(data.get('hardware')))}) and measured</h2>"
            f"<table><tr><th></th><th>predicted</th><th>measured</th></tr>{body}</table>"
        )
    split = "".join(f"<tr><th>{esc(k)}</th><td>{v:.2f}</td></tr>" for k, v in parts.items())
    body = f"<table>{rows}</table>{images}<h2>Step time (ms, median)</h2><table>{split}</table>{layout}{prediction}"
    return _page("Run report", body)


def _replica_rows(history: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Fault-tolerant replica groups (torchft): the fewest groups a step committed with, this group's recoveries, the
    steps it missed and the steps dropped; none without them."""
    quorum = [r["replicas/participants"] for r in history if "replicas/participants" in r]
    if not quorum:
        return []
    last = next(r for r in reversed(history) if "replicas/participants" in r)
    return [
        ("replica groups in the quorum (fewest, last)", f"{min(quorum):g}, {quorum[-1]:g}"),
        ("this group's recoveries from a peer", f"{last['replicas/recoveries']:g}"),
        ("steps this group missed", f"{last['replicas/missed_steps']:g}"),
        ("steps no group applied (a group failed them)", f"{last.get('replicas/dropped_steps', 0):g}"),
    ]


def _page(title: str, body: str) -> str:
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>lightning-dist {html.escape(title.lower())}</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}td,th{padding:2px 8px;text-align:left}"
        f"img{{max-width:100%}}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def render_comparison(out_dir: Path, runs: Sequence[Path | dict[str, Any]], title: str = "Runs compared") -> Path:
    """Overlay several runs' loss against tokens seen: ``compare.html`` and ``compare_loss.png`` in ``out_dir``.

    Each run is a run folder (its ``report.json``) or such a summary as a dict, named by its ``label`` key, else its
    folder's name. The plot: ``val/loss`` where the histories hold it, and ``train/loss`` as a moving mean (1/25 of
    the shortest run), with the loss floor. The table: ``val/loss`` at the same tokens, the final values and their
    gaps to the first run's and to the floor, and the data-parallel bytes per step. Returns the HTML path.
    """
    import matplotlib  # optional dependency: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = [_load(run) for run in runs]
    if not loaded:
        raise ValueError("render_comparison: no runs given; pass at least one run folder")
    in_tokens = all(tokens_per_step(r) for r in loaded)  # one x axis for all: steps when any has no tokens count
    window = max(1, min(len(r.get("history", [])) for r in loaded) // 25)
    curves = [loss_curves(r, window, in_tokens) for r in loaded]
    panels = [k for k in ("val/loss", "train/loss") if any(k in c for c in curves)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.5), squeeze=False)
    floors = [r["loss_floor"] for r in loaded if r.get("loss_floor") is not None]
    for ax, key in zip(axes[0], panels):
        for run, found in zip(loaded, curves):
            if key in found:
                style = {"marker": "o", "markersize": 3} if key == "val/loss" else {"linewidth": 1}
                ax.plot(*zip(*found[key]), label=run["label"], **style)
        _floors(ax, loaded)
        # from the loss a tenth of the way in (the first steps' loss would flatten the rest) down to the floor
        values = [
            y for c in curves for i, (_, y) in enumerate(c.get(key, [])) if key == "val/loss" or i >= len(c[key]) // 10
        ]
        low, high = min(values + floors), max(values)
        pad = 0.05 * (high - low) or 0.01
        ax.set_ylim(low - pad, high + pad)
        name = key if key == "val/loss" else f"train/loss, {window}-step mean"
        ax.set(xlabel=_x_label(in_tokens), ylabel="loss (nats/token)", title=name)
        ax.legend(fontsize=7)
    image = _save(fig, out_dir / "compare_loss.png")
    plt.close("all")
    esc = html.escape
    body = (
        f"<p>{len(loaded)} runs; gaps are to {esc(loaded[0]['label'])}; x: {esc(_x_label(in_tokens))}.</p>"
        f'<img alt="compare_loss.png" src="data:image/png;base64,{image}">'
        f"<h2>Loss at the same tokens</h2>{comparison_table(loaded, in_tokens, window)}"
    )
    page = out_dir / COMPARE_HTML
    page.write_text(_page(title, body))
    return page


def comparison_table(runs: list[dict[str, Any]], in_tokens: bool, window: int) -> str:
    """The comparison's HTML table: one row per run, ``val/loss`` at each checkpoint (tokens, or steps)."""
    vals = [dict(loss_curves(r, 1, in_tokens).get("val/loss", [])) for r in runs]
    points = sorted({round(x, 6) for v in vals for x in v})
    unit = "M tok" if in_tokens else " steps"

    def final(run: dict[str, Any]) -> float | None:  # val/loss, else the last window's train/loss
        train = loss_curves(run, window).get("train/loss")
        return run["val_loss"] if run.get("val_loss") is not None else (train[-1][1] if train else None)

    finals = [final(r) for r in runs]
    head = [
        "run",
        "layout",
        "tokens seen",
        *(f"{x:.3g}{unit}" for x in points),
        "final val/loss (else train)",
        f"vs {runs[0]['label']}",
        "vs floor",
        "comm/dp bytes / step",
        "DiLoCo bytes / step",
        "wall s",
    ]
    rows = []
    for run, val, loss in zip(runs, vals, finals):
        history = run.get("history", [])
        dp = [r["comm/dp/bytes"] for r in history if "comm/dp/bytes" in r]
        diloco = [r["diloco/bytes_per_step"] for r in history if "diloco/bytes_per_step" in r]
        at, floor = {round(x, 6): y for x, y in val.items()}, run.get("loss_floor")
        cells = [
            run["label"],
            run.get("layout", "-"),
            _count(_tokens_seen(run)),
            *(f"{at[x]:.4f}" if x in at else "-" for x in points),
            _num(loss),
            _num(loss - finals[0] if loss is not None and finals[0] is not None else None, "+"),
            _num(loss - floor if loss is not None and floor is not None else None, "+"),
            _count(statistics.median(dp) if dp else None),
            _count(diloco[-1] if diloco else None),
            _count(run.get("wall_time_s")),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><tr>{header}</tr>{''.join(rows)}</table>"


def _num(value: float | None, sign: str = "") -> str:
    return f"{value:{sign}.4f}" if value is not None else "-"


def _load(run: Path | dict[str, Any]) -> dict[str, Any]:
    """A run's summary (a copy) with its ``label``."""
    if isinstance(run, dict):
        data = dict(run)
        name = Path(str(data.get("output_dir") or "run")).name
    else:
        path = Path(run) / REPORT_JSON
        if not path.is_file():
            raise ValueError(f"{run} has no {REPORT_JSON}; give the folder of a finished run")
        data, name = json.loads(path.read_text()), Path(run).name
    data.setdefault("label", name)
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-report", description="(Re)write a run folder's report.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=[],
        metavar="RUN_DIR",
        help=f"write {COMPARE_HTML} instead: run_dir's loss vs tokens overlaid with these runs'",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"the folder for {COMPARE_HTML} (default: run_dir)")
    args = parser.parse_args(argv)
    for run_dir in (args.run_dir, *args.compare):
        if not (run_dir / REPORT_JSON).is_file():
            sys.exit(f"lightning-dist-report: {run_dir} has no {REPORT_JSON}; give the folder of a finished run.")
    if args.compare:
        print(render_comparison(args.out or args.run_dir, [args.run_dir, *args.compare]))
    else:
        print(render(args.run_dir))


if __name__ == "__main__":
    main()
