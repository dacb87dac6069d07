"""``make gpu-check``: everything this project can only learn on a GPU, in one command, into one table.

1. The GPU tests (``pytest -m gpu``: ``tests/gpu`` and the GPU cases of the other tiers): bf16 training, bf16 FSDP2
   against fp32, no host synchronization on the steps that do not log (CUDA's sync debug mode), an async sharded
   checkpoint resumed in a new folder bit-identically, and every multi-GPU layout's first and last rank rehearsed on
   this one GPU over torch's fake backend (``tests/gpu/test_rehearse_gpu.py``: sync debug mode, peak memory against
   the planner).
2. Throughput (``benchmarks/gpu_throughput.py``): the app against a plain torch loop, eager and compiled, the built-in
   GPT and transformers' Llama of the same 1.24B shape at sequence 2048.

It prints one markdown table and, with ``--write-docs``, puts it into ``docs/benchmarks.md`` (between the
``gpu-check`` markers) with the GPU, the torch version and the date; with ``$OUT`` set (the device tool) it also
writes ``$OUT/gpu-check.md``. At most ~8 minutes on one H100 with no network: where Hydra / OmegaConf are missing
(a typical GPU image), ``make gpu-wheels`` on a machine with network puts them in ``.whl/`` and ``make gpu-check``
installs them from there first. ``--smoke`` runs the whole script on the CPU with a tiny model and two throughput
rows (``tests/test_gpu_check.py``), so it cannot break unseen between GPU sessions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark script, imported as a module

import gpu_throughput

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
GIB = 2**30


def environment() -> str:
    """One line: the device, torch / CUDA, Lightning and transformers versions, the date."""
    import lightning
    import torch

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "-"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    cuda = torch.version.cuda or "none"
    today = datetime.date.today().isoformat()
    versions = f"torch {torch.__version__} (CUDA {cuda}), Lightning {lightning.__version__}, transformers {hf}"
    return f"{device}; {versions}; {today}"


def run_tests(report: Path, timeout_s: float, smoke: bool) -> list[str]:
    """``pytest -m gpu`` (its own process), each test's outcome and seconds as table rows."""
    xml = report / "gpu-tests.xml"
    paths = ["tests/gpu"] if smoke else ["tests"]
    command = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "-o", "addopts=-ra"]  # fmt: skip
    env = {**os.environ, "LIGHTNING_DIST_GPU_REPORT": str(report), "PYTHONPATH": _pythonpath()}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        tail = (done.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        tail = f"timed out after {timeout_s:.0f} s"
    rows = ["| GPU test | outcome | s |", "|---|---|---|"]
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    message = (found.get("message") or "").splitlines()[0][:160] if found.get("message") else ""
                    outcome = f"{kind}: {message}".replace("|", "/")
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            rows.append(f"| {name} | {outcome} | {float(case.get('time', 0)):.1f} |")
    rows.append(f"| (pytest: {tail}) | | {time.perf_counter() - started:.0f} |")
    return rows


def rehearsal_rows(report: Path) -> list[str]:
    """What ``tests/gpu/test_rehearse_gpu.py`` recorded: each rehearsed rank's quiet steps and peak memory."""
    path = report / "rehearse.jsonl"
    if not path.exists():
        return []
    rows = ["| rehearsed rank | quiet steps without sync | peak GiB | planned GiB | peak / planned |",
            "|---|---|---|---|---|"]  # fmt: skip
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ratio = r["peak"] / r["planned"] if r.get("peak") and r.get("planned") else None
        rows.append(f"| {r['layout']} rank {r['rank']} | {r['checked']} | {(r['peak'] or 0) / GIB:.2f} | "
                    f"{(r['planned'] or 0) / GIB:.2f} | {f'{ratio:.2f}' if ratio else '-'} |")  # fmt: skip
    return rows


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def write_docs(text: str, docs: Path) -> None:
    """Put ``text`` between the gpu-check markers of ``docs`` (appended with them when absent)."""
    page = docs.read_text() if docs.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in page and END in page:
        page = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, page, flags=re.S)
    else:
        page = page.rstrip() + "\n\n## On one GPU: `make gpu-check`\n\n" + block + "\n"
    docs.write_text(page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="on the CPU, tiny: checks this script, not the GPU")
    parser.add_argument("--rows", nargs="+", default=None, help="throughput rows (default: all; --smoke: two)")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--tests-timeout", type=float, default=270.0)
    parser.add_argument("--row-timeout", type=float, default=150.0)
    args = parser.parse_args()
    rows = args.rows or (["plain-gpt-eager", "app-gpt-fsdp-eager"] if args.smoke else list(gpu_throughput.ROWS))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder)
        tests = run_tests(report, args.tests_timeout, args.smoke)
        rehearsed = rehearsal_rows(report)
    measured = gpu_throughput.run_rows(rows, args.smoke, steps=10, timeout_s=args.row_timeout)
    lines = [f"`make gpu-check` on {environment()}; {time.perf_counter() - started:.0f} s in all.", "", *tests, ""]
    if rehearsed:
        lines += [*rehearsed, ""]
    lines += ["Throughput (1.24B Llama shape, sequence 2048, micro batch 4, bf16; `benchmarks/gpu_throughput.py`):",
              "", *gpu_throughput.table(measured)]  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    if args.write_docs:
        write_docs(text, Path(args.docs))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-check.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
