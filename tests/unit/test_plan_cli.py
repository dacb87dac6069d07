"""lightning-dist-plan's first run: the app's own --help, the sequence length it plans said (a built-in model's
max_seq_len rather than the synthetic data's 128), the layouts that change the math (DiLoCo) ranked apart from the
synchronous ones, and a table that fits 120 columns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_config

from lightning_dist import __version__
from lightning_dist.plan.cli import plan

SCRIPT = shutil.which("lightning-dist-plan", path=str(Path(sys.executable).parent)) or "lightning-dist-plan"
#: One node of 8 GPUs and a 1B model: a search of a second or two, with replicas (so DiLoCo layouts too).
JOB = ["model=llama_1b", "cluster=node_8gpu", "data.global_batch_size=16", "plan.top=3"]


def test_a_built_in_models_plan_takes_its_max_seq_len_and_says_so() -> None:
    from lightning_dist.plan.cli import adopt_model_seq_len

    cfg = compose_config(["model=llama_8b"])
    assert cfg.data.seq_len == 128  # the synthetic data's, a test setting
    note = adopt_model_seq_len(cfg, given=False, recipe=False)
    assert cfg.data.seq_len == cfg.model.max_seq_len == 8192 and note.startswith("planning data.seq_len=8192: the mod")
    given = compose_config(["model=llama_8b", "data.seq_len=1024"])
    assert adopt_model_seq_len(given, given=True, recipe=False) is None and given.data.seq_len == 1024
    hf = compose_config(["model=hf"])  # its context may be far longer than it trains on: kept, and said
    assert adopt_model_seq_len(hf, given=False, recipe=False).startswith("planning data.seq_len=128: the synthetic")


def test_the_table_fits_120_columns_and_ranks_diloco_apart(capsys: pytest.CaptureFixture) -> None:
    found = plan(compose_config([*JOB, "data.seq_len=2048"]))
    diloco = [e.layout.diloco for e in found]
    assert any(diloco) and not all(diloco)
    assert diloco == sorted(diloco)  # every synchronous layout before every DiLoCo one
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120
    synchronous, apart = out.index("synchronous (every step"), out.index("DiLoCo (replicas train apart")
    assert synchronous < apart and out.count("H=50") >= 1 and "H=50" not in out[:apart]


def test_the_json_lists_the_synchronous_layouts_first(capsys: pytest.CaptureFixture) -> None:
    plan(compose_config([*JOB, "data.seq_len=2048", "plan.format=json"]))
    found = json.loads(capsys.readouterr().out)
    syncs = [item["layout"].get("sync", "every_step") for item in found]
    assert "diloco" in syncs and syncs == sorted(syncs, key=lambda sync: sync == "diloco")


def test_plan_help_is_the_apps_own() -> None:
    done = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith(f"lightning-dist-plan {__version__}: rank every layout") and "_schema" not in text
    assert "powered by Hydra" not in text and "  plan.top: int = 10" in text and "data.seq_len" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    field = subprocess.run([SCRIPT, "--help", "plan.format"], capture_output=True, text=True, timeout=120)
    assert field.returncode == 0 and field.stdout.startswith("plan.format: str = table\n")
