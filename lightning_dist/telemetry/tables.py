"""The end-of-fit telemetry tables (communication per axis and op; the layout) and their plain-text form."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning_dist.parallel_dims import DP, ParallelDims
from lightning_dist.telemetry.comm import AXIS_ORDER, OpStats

Table = tuple[list[str], list[list[Any]]]


def comm_table(totals: dict[tuple[str, str], OpStats]) -> Table:
    """One row per (axis, op): calls, MiB, how many calls were timed, ms per timed call and bus bandwidth."""
    columns = ["axis", "op", "calls", "MiB", "timed_calls", "ms_per_call", "busbw_GBps"]
    order = {axis: i for i, axis in enumerate(AXIS_ORDER)}
    rows = []
    for (axis, op), s in sorted(totals.items(), key=lambda item: (order.get(item[0][0], 99), item[0][1])):
        ms_per_call = s.seconds * 1e3 / s.timed_count if s.timed_count else float("nan")
        mib = round(s.bytes / 2**20, 3)
        rows.append([axis, op, s.count, mib, s.timed_count, round(ms_per_call, 3), round(s.busbw_gbps, 3)])
    return columns, rows


def layout_table(dims: ParallelDims | None, world_size: int) -> Table:
    """Each rank's coordinate on every mesh axis (Lightning's own strategies: every rank is a ``dp`` rank)."""
    if dims is not None:
        rows = [[rank, *dims.coordinates(rank).values()] for rank in range(dims.world_size)]
        return ["rank", *dims.degrees], rows
    return ["rank", DP], [[rank, rank] for rank in range(world_size)]


def write_csv(path: Path, columns: list[str], rows: list[list[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(rows)


def format_summary(tables: dict[str, Table], num_steps: int) -> str:
    """The end-of-fit tables as plain text (what rank 0 prints)."""
    lines = [f"Telemetry summary ({num_steps} optimizer steps)"]
    for name, (columns, rows) in tables.items():
        lines.append(f"{name}:")
        cells = [columns, *[[str(cell) for cell in row] for row in rows]]
        widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
        lines.extend("  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells)
        if not rows:
            lines.append("  (none)")
    return "\n".join(lines)
