"""``make gpu-check`` cannot break unseen between the sessions that have a GPU: its script runs here end to end on the
CPU (``--smoke``: the GPU tests collected and skipped, two throughput rows with a tiny model), and its table lands in
a docs page between its markers, replacing the last one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_the_cpu_and_writes_its_table(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nearlier text\n")
    command = [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--write-docs", f"--docs={docs}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import write_docs

    write_docs(docs.read_text().split("<!-- gpu-check:begin -->\n")[1].split("\n<!-- gpu-check:end -->")[0], docs)
    page = docs.read_text()  # written again over itself: one table, the same
    assert page.startswith("# Benchmarks\n\nearlier text\n") and page.count("<!-- gpu-check:begin -->") == 1
    table = page.split("<!-- gpu-check:begin -->")[1]
    assert "test_rehearse_gpu::test_a_layouts_first_and_last_rank_place_themselves_on_one_gpu[tp2]" in table
    for row in ("plain-gpt-eager", "app-gpt-fsdp-eager"):
        line = next(line for line in table.splitlines() if line.startswith(f"| {row} |"))
        assert "failed" not in line and float(line.split("|")[2].replace(",", "")) > 0, line
