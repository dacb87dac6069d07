"""Meta-device initialization: a sharded rank never holds the whole model, and starts from the one-process weights.

Peak resident memory grows, from just before the model is built to the first training step, by the model's size in
one process and by about a 1/N share of it (plus a stated constant) on each of N sharded ranks. Values equal one
process's (the layout tests compare every step's loss and gradient norm).
"""

from __future__ import annotations

import resource
from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers import FAST, compose_config

from lightning_dist.launch import launch
from lightning_dist.telemetry.throughput import resident_memory_bytes

#: ~200 MB of fp32 parameters (8 blocks of width 768), one step, no optimizer state yet at the first step's start.
BIG = ["model.d_model=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=4", "trainer.max_steps=1"]
MB = 2**20
#: What a sharded rank may hold beyond its share and beyond the one process's own overhead (measured in the same
#: test): one whole parameter while it is initialized (6.3 MB here), FSDP2 / DTensor state, allocator slack.
#: Measured on 2026-11-23 with this 194 MB model: one process grows by 215 MB, fsdp2 / tp2 ranks by 133-136 MB
#: (half + 36-39 MB, i.e. 15-18 MB over the one-process overhead); without meta init they grow by the whole 215 MB.
CONSTANT = 32 * MB


class _PeakMemory(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = resident_memory_bytes()  # the model is not built yet (configure_model comes after setup)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters())  # global sizes (DTensor)
        self.result = {"growth": peak - self.before, "model_bytes": params}


def _fit(cfg) -> dict:
    from lightning_dist.app import fit

    probe = _PeakMemory()
    fit(cfg, callbacks=(probe,))
    return probe.result


@pytest.mark.parametrize(
    ("layout", "shards"),
    [
        (["parallelism=fsdp", "cluster.devices=2"], 2),
        (["parallelism=tp", "cluster.devices=2"], 2),
        (["parallelism=pp", "cluster.devices=2", "parallelism.split_points=[layers.4]"], 2),
        # Each stage is sharded before it is materialized: a rank holds a quarter, never its whole stage.
        (["parallelism=pp", "cluster.devices=4", "parallelism.split_points=[layers.4]"], 4),
    ],
    ids=["fsdp2", "tp2", "pp2", "pp2xfsdp2"],
)
def test_a_sharded_rank_never_holds_the_whole_model(layout: list[str], shards: int, tmp_path: Path) -> None:
    one = launch(_fit, 1, compose_config([*FAST, *BIG, "parallelism=fsdp", "cluster.devices=1"], tmp_path / "one"))[0]
    assert one["growth"] > 0.9 * one["model_bytes"]  # one process: the whole model, as the test's own baseline
    overhead = max(0, one["growth"] - one["model_bytes"])  # what any run adds besides the parameters
    for rank in launch(_fit, shards, compose_config([*FAST, *BIG, *layout], tmp_path / "sharded")):
        limit = one["model_bytes"] / shards + overhead + CONSTANT
        assert rank["growth"] < limit, (rank["growth"] / MB, limit / MB, one["growth"] / MB)
