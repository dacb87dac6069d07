"""``lightning-dist-reproduce RECIPE``: run a recipe and hold it to its golden file for this kind of machine.

The run is made in two halves: the first half saves a checkpoint, the second resumes from it in the same folder.
So one run checks both what the recipe claims and that a resumed run equals an uninterrupted one (the golden curve
was recorded uninterrupted). Compared, with the tolerances the golden file states:

- the training loss of every step (relative tolerance ``loss_rtol``);
- tokens/s (the median of what the telemetry logged) and peak memory per rank, each within its band, a
  ``[low, high]`` factor of the recorded value (wide on a shared CPU; timing is not what a CPU run proves).

Prints expected / measured / verdict per check and exits 1 on any miss. ``--update`` records a new golden file
(uninterrupted). ``--steps N`` checks the first N steps only (the LR schedule keeps the recipe's length).

    lightning-dist-reproduce tiny_ddp_cpu
    lightning-dist-reproduce tiny_tp_cpu --steps 40
    lightning-dist-reproduce tiny_pp_cpu --update
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_dist.config.schema import CONF_DIR, TrainConfig, register_configs, to_train_config
from lightning_dist.run.train import run

GOLDEN_DIR = CONF_DIR / "recipe" / "golden"
DEFAULT_TOLERANCES = {"loss_rtol": 1e-4, "tokens_per_sec_band": [0.2, 5.0], "memory_band": [0.5, 2.0]}


def machine_kind() -> str:
    """``cpu``, or the GPU's name in lower case with spaces as dashes (``nvidia-h100-80gb-hbm3``)."""
    return torch.cuda.get_device_name(0).lower().replace(" ", "-") if torch.cuda.is_available() else "cpu"


def compose(recipe: str, overrides: list[str]) -> TrainConfig:
    """The recipe's config, as ``lightning-dist-train recipe=<recipe> <overrides>`` composes it."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = hydra_compose(config_name="train", overrides=[f"recipe={recipe}", *overrides])
    return to_train_config(raw)


def measure(recipe: str, steps: int | None, out_dir: Path, halves: bool) -> dict[str, Any]:
    """Run the recipe (in two halves with a resume between them when ``halves``) and return what was measured."""
    base = compose(recipe, [])
    total = base.trainer.max_steps
    steps = steps or total
    common = [
        f"optim.decay_steps={base.optim.decay_steps or total}",
        "logger=none",
        "trainer.enable_progress_bar=false",
    ]
    started = time.perf_counter()
    if halves:
        first = run(
            _with(recipe, [*common, f"trainer.max_steps={steps // 2}", "trainer.enable_checkpointing=true"], out_dir)
        )
        second = run(_with(recipe, [*common, f"trainer.max_steps={steps}", f"resume={out_dir}"], out_dir))
        records = first["history"] + second["history"]
    else:
        records = run(_with(recipe, [*common, f"trainer.max_steps={steps}"], out_dir))["history"]
    speeds = [r["perf/tokens_per_sec"] for r in records if "perf/tokens_per_sec" in r]
    memory = [r.get("memory/peak_allocated_gib", r.get("memory/rss_gib")) for r in records]
    return {
        "loss": [r["train/loss"] for r in records],
        "tokens_per_sec": statistics.median(speeds[len(speeds) // 2 :]) if speeds else None,
        "memory_gib": max((m for m in memory if m is not None), default=None),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _with(recipe: str, overrides: list[str], out_dir: Path) -> TrainConfig:
    cfg = compose(recipe, overrides)
    cfg.output_dir = str(out_dir)
    return cfg


def compare(golden: dict[str, Any], measured: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(check, expected, measured, passed) rows."""
    rows = []
    expected = golden["loss"][: len(measured["loss"])]
    rtol = golden.get("loss_rtol", DEFAULT_TOLERANCES["loss_rtol"])
    worst = max((abs(m - e) / max(abs(e), 1e-12) for m, e in zip(measured["loss"], expected, strict=True)), default=0.0)
    rows.append(
        (
            f"loss, {len(expected)} steps (resumed at half)",
            f"rtol {rtol:g}",
            f"max rel. diff {worst:.2e}",
            worst <= rtol and len(expected) == len(measured["loss"]),
        )
    )
    rows.append(("final loss", f"{expected[-1]:.4f}", f"{measured['loss'][-1]:.4f}", worst <= rtol))
    for key, band_key, unit in (
        ("tokens_per_sec", "tokens_per_sec_band", "tokens/s"),
        ("memory_gib", "memory_band", "GiB per rank"),
    ):
        if golden.get(key) is None or measured.get(key) is None:
            rows.append((unit, str(golden.get(key)), "not measured", True))
            continue
        low, high = golden.get(band_key, DEFAULT_TOLERANCES[band_key])
        ok = low * golden[key] <= measured[key] <= high * golden[key]
        rows.append((unit, f"{golden[key]:.4g} (x{low:g}..x{high:g})", f"{measured[key]:.4g}", ok))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="a recipe name (recipes/<name>.yaml)")
    parser.add_argument("--steps", type=int, help="check only the first N steps (default: the whole recipe)")
    parser.add_argument("--update", action="store_true", help="record a new golden file for this machine kind")
    parser.add_argument("--golden", type=Path, help="the golden file (default: recipes/golden/<recipe>.<kind>.json)")
    parser.add_argument("--out", type=Path, help="the run folder (default: a temporary one)")
    args = parser.parse_args(argv)
    kind = machine_kind()
    path = args.golden or GOLDEN_DIR / f"{args.recipe}.{kind}.json"
    if not args.update and not path.is_file():
        sys.exit(
            f"lightning-dist-reproduce: no golden file {path} for {args.recipe} on {kind}: not measured here "
            f"yet; record one with --update."
        )
    with tempfile.TemporaryDirectory(prefix="lightning-dist-reproduce-") as tmp:
        out = args.out or Path(tmp) / "run"
        measured = measure(args.recipe, args.steps, out, halves=not args.update)
    if args.update:
        golden = {
            "recipe": args.recipe,
            "machine": kind,
            "recorded": time.strftime("%Y-%m-%d"),
            **DEFAULT_TOLERANCES,
            **{k: measured[k] for k in ("loss", "tokens_per_sec", "memory_gib")},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"recorded {path}: {len(measured['loss'])} steps, final loss {measured['loss'][-1]:.4f}")
        return
    golden = json.loads(path.read_text())
    rows = compare(golden, measured)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.recipe} on {kind} against {path.name} ({measured['wall_s']} s)")
    for column in ("check", "expected", "measured", "verdict"):
        table.add_column(column)
    for check, expected, got, ok in rows:
        table.add_row(check, expected, got, "[green]pass[/]" if ok else "[red]MISS[/]")
    Console(width=140).print(table)
    if not all(ok for *_, ok in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
