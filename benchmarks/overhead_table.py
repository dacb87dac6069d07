"""One command for the library-overhead table: step time vs a plain torch loop (d256 and tiny GPT), and start-up.

Run by hand: ``.venv/bin/python benchmarks/overhead_table.py [--quick] [--rows d256 tiny startup]``.

Each row comes from the functions of ``step_overhead.py`` (2 ranks launched once per layout, library and plain
loop interleaved in the same processes) and ``startup.py`` (whole processes timed); their docstrings say what is
measured and how. ``--quick`` is a smoke run (1 round of 10 steps, 1 start-up repeat): its numbers mean nothing.
The full run takes about 15 minutes on 2 cores.

Columns: ``library`` / ``plain`` are the median over rounds of each round's median ms per step (start-to-start,
rank 0); ``ratio`` is library / plain of those; ``ratio (mean)`` the same for the mean step, which also counts what
runs on one step in ``log_every_n_steps`` (logging, Telemetry's sampled comm timing). Telemetry rows: on - off,
paired within a round, mean step. Targets are the issue's.

Results (2026-11-24, 2-core VM): docs/benchmarks.md, "Per-step overhead and start-up".
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import lightning
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts, imported as modules

import startup
import step_overhead

NAMES = {"ddp": "DDP", "fsdp": "FSDP2 dp_shard=2", "tp": "TP tp=2", "pp": "PP pp=2 (1F1B)"}


def machine() -> str:
    """CPU model, cores, load, torch / Lightning versions and the date, for the top of the table."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = models[0] if models else platform.processor() or "?"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        f"{now}; {cpu}, {os.cpu_count()} cores (load {load}); Python {platform.python_version()}, torch "
        f"{torch.__version__}, lightning {lightning.__version__}; 2 ranks x 1 thread, gloo"
    )


def step_rows(m: step_overhead.Measured, label: str, target: str) -> list[list[str]]:
    """Table rows of one layout: telemetry on / off when both ran."""
    modes = [v for v in ("library on", "library off") if v in m.medians]
    plain, plain_mean = m.median("plain"), m.median("plain", "mean")

    def joined(values: list[float], fmt: str) -> str:
        return " / ".join(format(v, fmt) for v in values)

    lib = [m.median(v) for v in modes]
    ratios = [m.median(v) / plain for v in modes]
    mean_ratios = [m.median(v, "mean") / plain_mean for v in modes]
    extra = [m.median(v) - plain for v in modes]
    return [
        [
            f"{label}, telemetry {' / '.join(v.split()[1] for v in modes)}",
            joined(lib, ".2f"),
            f"{plain:.2f}",
            joined(ratios, ".3f"),
            joined(mean_ratios, ".3f"),
            joined(extra, "+.2f") + " ms",
            target,
        ]
    ]


def telemetry_row(results: dict[str, step_overhead.Measured], model: str, target: str, percent: bool) -> list[str]:
    """Telemetry on - off per layout (paired, mean step): ms, or % of the off step."""
    values = []
    for m in results.values():
        if "library on" not in m.means or "library off" not in m.means:
            continue
        diff = m.paired_diff("library on", "library off")
        values.append(f"{diff / m.median('library off', 'mean') * 100:+.1f}%" if percent else f"{diff:+.2f} ms")
    label = f"telemetry on - off, {model}, per step ({' / '.join(NAMES[k].split()[0] for k in results)})"
    return [label, " / ".join(values), "", "", "", "", target]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of 10 steps, 1 start-up repeat")
    parser.add_argument("--rows", nargs="+", choices=("d256", "tiny", "startup"), default=["d256", "tiny", "startup"])
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run; default 30 (--quick: 10)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (--quick: 2)")
    parser.add_argument("--repeats", type=int, default=None, help="start-up repeats; default 5 (--quick: 1)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (10 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats or (1 if args.quick else 5)
    header = machine()

    def run(layout: str, model: str) -> step_overhead.Measured:
        print(f"measuring {layout} {model} ...", file=sys.stderr, flush=True)
        m = step_overhead.measure(layout, model, "both", rounds, steps, warmup)
        step_overhead.report(m)  # the detailed table of the layout, on stdout before the summary
        return m

    rows: list[list[str]] = []
    if "d256" in args.rows:
        big = {layout: run(layout, "d256") for layout in ("ddp", "fsdp")}
        for layout, m in big.items():
            rows += step_rows(m, f"{NAMES[layout]}, GPT d256 L4, ms/step", "<= 1.02")
        rows.append(telemetry_row(big, "d256", "<= 1%", percent=True))
    if "tiny" in args.rows:
        tiny = {layout: run(layout, "tiny") for layout in step_overhead.LAYOUTS}
        for layout, m in tiny.items():
            model = m.bench.describe_model().split(",")[0]
            rows += step_rows(m, f"{NAMES[layout]}, tiny GPT ({model}), ms/step", "<= 1.10 (on)")
        rows.append(telemetry_row(tiny, "tiny", "<= 0.5 ms", percent=False))
    if "startup" in args.rows:
        print("measuring start-up ...", file=sys.stderr, flush=True)
        times = startup.measure(repeats)
        app, plain = (statistics.median(times[k]) for k in ("app", "plain"))
        label = "start-up to exit, 1-step default run vs torchrun + plain script, s"
        rows.append([label, f"{app:.2f}", f"{plain:.2f}", f"{app / plain:.2f}", "", f"{app - plain:+.2f} s", "<= 1.30"])
        imports = " / ".join(f"{statistics.median(times[f'import {m}']):.2f}" for m in ("torch", "lightning"))
        own = statistics.median(times["import lightning_dist.run.train"])
        rows.append(["import torch / lightning / lightning_dist.run.train, s", f"{imports} / {own:.2f}", *[""] * 5])
        header += f"; {startup.pyc_note('env')}"
    columns = ["measure", "library", "plain", "ratio", "ratio (mean)", "library - plain", "target"]
    print(f"\n{header}")
    print(f"{rounds} rounds x {steps} steps after {warmup} warm-up; start-up: median of {repeats}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
