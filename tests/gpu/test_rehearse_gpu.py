"""Every multi-GPU layout's first and last rank on one GPU (``lightning_dist/run/rehearse.py``): real CUDA tensors,
torch's fake backend for the other ranks, CUDA's sync debug mode on the steps that do not log, and the peak memory
next to the planner's estimate. The CPU suite rehearses the same layouts on CPU tensors
(``tests/distributed/test_rehearse.py``); ``make gpu-check`` runs this file and tabulates what it records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST, compose_config
from sync_debug import NoSyncBetweenQuietSteps

from lightning_dist.run.launch import launch

pytestmark = pytest.mark.gpu

#: A 150M Llama-shape GPT at sequence 1024: large enough for memory to mean something, quick to initialize.
MODEL = ["model.vocab_size=32000", "model.n_layers=8", "model.d_model=1024", "model.n_heads=16",
         "model.n_kv_heads=4", "model.max_seq_len=1024", "data.seq_len=1024", "data.global_batch_size=8"]  # fmt: skip
STEPS = ["trainer.max_steps=8", "trainer.log_every_n_steps=4", "cluster=gpu"]
LAYOUTS = {
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "cp2-allgather": [
        "parallelism=fsdp",
        "parallelism.dp_shard=1",
        "parallelism.cp=2",
        "cluster.devices=2",
        "parallelism.context.attention=allgather",
    ],
    "cp2-torch": [
        "parallelism=fsdp",
        "parallelism.dp_shard=1",
        "parallelism.cp=2",
        "cluster.devices=2",
        "parallelism.context.attention=torch",
    ],
    "tp2xfsdp4": ["parallelism=tp_fsdp", "parallelism.tp=2", "cluster.devices=8"],
    "hsdp2x4": ["parallelism=fsdp", "parallelism.dp_replicate=2", "parallelism.dp_shard=4", "cluster.devices=8"],
    "diloco2x2": ["parallelism=diloco", "parallelism.diloco.every=3", "parallelism.dp_shard=2", "cluster.devices=4"],
}


def _rehearse_first_and_last(cfg: Any) -> dict[str, Any]:
    """Process 0 rehearses rank 0, process 1 the last rank, side by side on the one GPU."""
    from lightning_dist.run.rehearse import planned_memory, rehearse

    rank = 0 if os.environ["RANK"] == "0" else cfg.cluster.devices * cfg.cluster.num_nodes - 1
    strict = NoSyncBetweenQuietSteps(cfg.trainer.log_every_n_steps)
    done = rehearse(cfg, rank, callbacks=[strict])
    return {"rank": rank, "steps": done.steps, "checked": strict.checked, "peak": done.peak_bytes,
            "planned": planned_memory(cfg).total}  # fmt: skip


def _record(name: str, found: dict[str, Any]) -> None:
    """Append to ``$LIGHTNING_DIST_GPU_REPORT/rehearse.jsonl`` for ``make gpu-check``'s table."""
    folder = os.environ.get("LIGHTNING_DIST_GPU_REPORT")
    if folder:
        with (Path(folder) / "rehearse.jsonl").open("a") as file:
            file.write(json.dumps({"layout": name, **found}) + "\n")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layouts_first_and_last_rank_place_themselves_on_one_gpu(name: str, tmp_path: Path) -> None:
    cfg = compose_config([*FAST, *MODEL, *STEPS, *LAYOUTS[name]], tmp_path)
    for found in launch(_rehearse_first_and_last, 2, cfg):
        _record(name, found)
        assert found["steps"] == 8, found
        assert found["checked"] == [3, 6, 7], found  # quiet pairs (2,3), (5,6), (6,7): no synchronization raised
        assert 0.5 <= found["peak"] / found["planned"] <= 1.5, found  # the planner's per-rank memory, within 50%
