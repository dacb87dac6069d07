"""Every layout places itself: its first and last rank rehearsed on this CPU (``lightning_dist/run/rehearse.py``).

Each rank runs the app's whole training step (Lightning's loop, the strategy, every default callback, the telemetry)
on real tensors, with torch's fake backend standing in for the other ranks, in a process of its own (torch caches
meshes by value, so a second world in one process would reach the first one's groups). What it holds (parameters
and AdamW state, as the telemetry measured them) is the planner's share for that rank. ``make gpu-check`` runs the
same rehearsals on CUDA with the sync debug mode on quiet steps (``tests/gpu/test_rehearse_gpu.py``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from helpers import FAST, compose_config

from lightning_dist.run.launch import RankFailedError, launch

#: The layouts of the GPU issue that one device can run as one rank (pipelines: see the refusal below).
LAYOUTS = {
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "cp2": ["parallelism=fsdp", "parallelism.dp_shard=1", "parallelism.cp=2", "cluster.devices=2"],
    "tp2xfsdp2": ["parallelism=tp_fsdp", "parallelism.tp=2", "cluster.devices=4"],
    "hsdp": ["parallelism=fsdp", "parallelism.dp_replicate=2", "parallelism.dp_shard=2", "cluster.devices=4"],
    "diloco": ["parallelism=diloco", "parallelism.diloco.every=2", "parallelism.dp_shard=2", "cluster.devices=4"],
}
SETTINGS = ["trainer.max_steps=4", "trainer.log_every_n_steps=2", "data.seq_len=64"]


def _rehearse_first_and_last(cfg: Any) -> dict[str, Any]:
    """Process 0 rehearses rank 0, process 1 the last rank (each process holds one world)."""
    import torch

    from lightning_dist.run.rehearse import planned_memory, rehearse

    torch.set_num_threads(1)
    world = cfg.cluster.devices * cfg.cluster.num_nodes
    rank = 0 if os.environ["RANK"] == "0" else world - 1
    done = rehearse(cfg, rank)
    last, planned = done.result.history[-1], planned_memory(cfg)
    return {
        "rank": done.rank,
        "steps": done.steps,
        "layout": done.layout,
        "state_gib": last["memory/params_gib"] + last["memory/optimizer_gib"],
        "planned_gib": (planned.params + planned.optimizer) / 2**30,
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_first_and_last_rank_of_each_layout_train_alone(name: str, tmp_path: Any) -> None:
    cfg = compose_config([*FAST, *SETTINGS, *LAYOUTS[name]], tmp_path)
    first, last = launch(_rehearse_first_and_last, 2, cfg)
    assert (first["rank"], last["rank"]) == (0, cfg.cluster.devices - 1)
    for done in (first, last):
        assert done["steps"] == 4, done
        assert done["state_gib"] == pytest.approx(done["planned_gib"], rel=0.05), done


def _rehearse_pipeline(cfg: Any) -> None:
    from lightning_dist.run.rehearse import rehearse

    rehearse(cfg, 0)


def test_a_pipeline_is_refused_in_one_line(tmp_path: Any) -> None:
    cfg = compose_config([*FAST, "parallelism=pp"], tmp_path)
    with pytest.raises(RankFailedError, match=r"parallelism.pp=2: a pipeline cannot be rehearsed"):
        launch(_rehearse_pipeline, 1, cfg)
