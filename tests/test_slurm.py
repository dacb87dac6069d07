"""``cluster=slurm`` through submitit's local executor, as far as this machine can stand in for SLURM: one job of 2
tasks (each task one rank, both in one run folder), and a 2-point ``-m`` sweep through Hydra's submitit launcher."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, run_app

pytest.importorskip("submitit")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

#: cluster=slurm, shaped for this machine: 2 CPU tasks on one "node", run by submitit's local executor.
LOCAL_SLURM = [
    "cluster=slurm",
    "cluster.slurm.executor=local",
    "cluster.accelerator=cpu",
    "cluster.devices=2",
    "cluster.precision=32-true",
    "cluster.process_group_backend=gloo",
    "cluster.slurm.gpus_per_node=null",
]
RUN = [*FAST, "parallelism=fsdp", "trainer.max_steps=3", "trainer.enable_checkpointing=true"]


def test_a_submitted_job_runs_one_rank_per_task_in_one_folder(tmp_path: Path) -> None:
    result = run_app([*RUN, *LOCAL_SLURM], tmp_path)
    assert result["job_id"] and result["steps"] == 3
    assert result["layout"] == "fsdp: pp=1 dp_replicate=1 dp_shard=2 tp=1 (world 2)"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    logs = sorted((tmp_path / ".submitit").glob("*_log.out"))
    assert len(logs) == 2  # two tasks, one process each: the app did not start ranks of its own inside them


@pytest.mark.slow  # the launcher config's fields: tests/unit/test_cluster.py::test_the_sweep_launcher_reads_the_cluster
def test_a_sweep_becomes_one_job_per_point(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_dist.run.train", "-m", "hydra/launcher=slurm_local", *RUN, *LOCAL_SLURM,
               f"hydra.sweep.dir={tmp_path}", "optim.lr=1e-3,3e-3"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    outputs = "".join(path.read_text() for path in (tmp_path / ".submitit").rglob("*_log.out"))
    assert len(re.findall(r"layout +: fsdp: .*\(world 2\)", outputs)) == 2  # each job: its 2 tasks as one run
