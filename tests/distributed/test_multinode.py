"""Two torchrun agents on this machine stand in for two nodes of 2 processes each (c10d rendezvous, 4 ranks): each
layout gives the one-process loss curve, with tp inside a node and dp / pp across, in one run folder for the job."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, losses, run_app

from lightning_dist.run.launch import free_port

RUN = [*FAST, "logger=csv", "trainer.max_steps=4", "model.n_layers=2"]
LAYOUTS = {
    "ddp": pytest.param(["parallelism=ddp"], marks=pytest.mark.slow),  # the same path: a second layout
    "pp2xtp2": ["parallelism=3d", "parallelism.dp_shard=1"],  # a stage per node, tp inside it
}


def torchrun_nodes(overrides: list[str], cwd: Path, nodes: int = 2, per_node: int = 2) -> list[subprocess.Popen]:
    """``nodes`` torchrun agents of ``per_node`` processes, the second started a moment after the first."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    port = free_port()
    command = [torchrun, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=job7", "-m", "lightning_dist.run.train"]  # fmt: skip
    agents = []
    for _ in range(nodes):
        agents.append(
            subprocess.Popen([*command, *overrides], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
        time.sleep(0.5)  # a node that starts later must still join the same job and run folder
    return agents


def finish(agents: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = [agent.communicate(timeout=timeout) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-3000:]
    return [stderr for _, stderr in outputs]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return losses(run_app([*RUN, "parallelism=fsdp", "cluster.devices=1"], tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_two_nodes_give_the_one_process_curve(layout: list[str], one_process: list[float], tmp_path: Path) -> None:
    # cluster.devices / cluster.num_nodes are not repeated: torchrun states them (2 per node, 2 nodes).
    stderrs = finish(torchrun_nodes([*RUN, *layout, "cluster.devices=1"], tmp_path))
    assert any("cluster.devices=2 cluster.num_nodes=2: as torchrun started the job" in err for err in stderrs)
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["torchrun-job7"]  # one folder for both nodes
    with (tmp_path / "outputs" / "torchrun-job7" / "csv" / "metrics.csv").open() as file:
        curve = [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]
    np.testing.assert_allclose(curve, one_process, rtol=1e-5)
