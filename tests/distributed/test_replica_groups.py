"""Fault-tolerant replica groups (torchft): without a failure the curve is HSDP's; a replica group killed mid-run
leaves the others training, is restarted alone, copies a healthy group's state and ends with its exact weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from helpers import FAST, losses, run_app
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_dist.checkpoint.store import latest_checkpoint

HSDP = [*FAST, "parallelism=fsdp", "parallelism.dp_replicate=2", "parallelism.dp_shard=2", "cluster.devices=4"]
TORCHFT = ["parallelism.replicas.recovery=torchft", "parallelism.replicas.heartbeat_timeout_s=2"]


def test_two_replica_groups_train_as_hsdp(tmp_path: Path) -> None:
    """2 replica groups x FSDP2 over 2 ranks, each group its own job meeting through torchft, give the HSDP curve of
    the same 4 ranks as one job: the same global batch, the gradients averaged over the groups each step."""
    hsdp = run_app(HSDP, tmp_path / "hsdp")
    groups = run_app([*HSDP, *TORCHFT], tmp_path / "torchft")
    np.testing.assert_allclose(losses(groups), losses(hsdp), rtol=1e-5)
    quorum = [r["replicas/participants"] for r in groups["history"] if "replicas/participants" in r]
    assert quorum and set(quorum) == {2.0}  # both groups in every step's quorum
    assert Path(groups["output_dir"]).name == "replica-0" and (tmp_path / "torchft" / "replica-1").is_dir()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _group_ranks(job: int, group: int) -> list[int]:
    """The rank processes of replica group ``group`` below process ``job`` (``ps`` shows ``group<g>-rank<r>``)."""
    found = []
    for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            if not Path(f"/proc/{pid}/comm").read_text().startswith(f"group{group}-rank"):
                continue
            ancestor = pid
            while ancestor not in (0, 1, job):
                ancestor = _parent(ancestor)
        except (OSError, IndexError, ValueError):
            continue
        if ancestor == job:
            found.append(pid)
    return found


def _weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}


def test_a_killed_replica_group_rejoins_from_a_peer_and_ends_with_its_weights(tmp_path: Path) -> None:
    steps = 24
    run_dir = tmp_path / "run"
    run = [
        *HSDP,
        *TORCHFT,
        f"trainer.max_steps={steps}",
        "trainer.enable_checkpointing=true",
        "checkpoint.every_n_steps=1",
        "resilience.max_restarts=1",
        "telemetry.report=true",
        f"output_dir={run_dir}",
    ]
    command = [sys.executable, "-m", "lightning_dist.run.train", *run]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 300
    group1 = run_dir / "replica-1" / "checkpoints"
    while (found := latest_checkpoint(group1)) is None or int(found.name.removeprefix("step-")) < 4:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.2)
    victims = _group_ranks(job.pid, 1)
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)  # one rank of group 1, mid-run
    _, stderr = job.communicate(timeout=400)
    assert job.returncode == 0, stderr[-3000:]
    assert "replica group 1 left at" in stderr and "was killed by signal SIGKILL" in stderr, stderr[-3000:]

    reports = [json.loads((run_dir / f"replica-{g}" / "report.json").read_text()) for g in (0, 1)]
    survivor = [r for r in reports[0]["history"] if "replicas/participants" in r]
    assert min(r["replicas/participants"] for r in survivor) == 1.0  # group 0 trained on alone for a while
    assert all(np.isfinite(r["train/loss"]) for r in reports[0]["history"] if "train/loss" in r)
    rejoined = [r for r in reports[1]["history"] if "replicas/recoveries" in r]
    assert rejoined[-1]["replicas/recoveries"] >= 1 and rejoined[-1]["replicas/missed_steps"] > 0
    assert reports[0]["steps"] == reports[1]["steps"] == steps

    final = [
        _weights(run_dir / f"replica-{g}" / "checkpoints" / f"step-{steps:08d}", tmp_path / f"{g}.pt") for g in (0, 1)
    ]
    assert final[0].keys() == final[1].keys() and final[0]
    for name, tensor in final[0].items():
        assert torch.equal(tensor, final[1][name]), f"{name} differs between the replica groups"
