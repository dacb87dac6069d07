"""Meta-device initialization: a sharded rank never holds the whole model, and starts from the one-process weights.

Peak resident memory grows, from just before the model is built to the first training step, by the model's size in
one process and by about a 1/N share of it (plus a stated constant) on each of N = 4 sharded ranks (dp_shard=4,
tp=2 x dp_shard=2, pp=2 x dp_shard=2); after the first optimizer step (gradients and AdamW's two moments added) by
4x the model in one process and about 4x its 1/N share on a sharded rank. Values equal one process's (the layout
tests compare every step's loss and gradient norm).
"""

from __future__ import annotations

import resource
from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers import FAST, compose_config

from lightning_dist.run.launch import launch
from lightning_dist.telemetry.throughput import resident_memory_bytes

#: ~200 MB of fp32 parameters (8 blocks of width 768), one step, no optimizer state yet at the first step's start.
BIG = ["model.d_model=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=4", "trainer.max_steps=1"]
MB = 2**20
#: What a sharded rank may hold beyond its share and beyond the one process's own overhead (measured in the same
#: test): one whole parameter while it is initialized (6.3 MB here), FSDP2 / DTensor state, allocator slack.
#: Measured on 2026-11-23 with this 194 MB model: one process grows by 215 MB, fsdp2 / tp2 ranks by 133-136 MB
#: (half + 36-39 MB, i.e. 15-18 MB over the one-process overhead); without meta init they grow by the whole 215 MB.
#: On 2026-11-24, after the first step: one process 989 MB (4 x 194 + 213), an fsdp4 rank 270 MB (194 + 76).
CONSTANT = 32 * MB


class _PeakMemory(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = resident_memory_bytes()  # the model is not built yet (configure_model comes after setup)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters())  # global sizes (DTensor)
        self.result = {"growth": _peak() - self.before, "model_bytes": params}

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        # After the first optimizer step: gradients and AdamW's two moments exist too (4x the parameters in all).
        self.result["growth_after_step"] = _peak() - self.before


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _fit(cfg) -> dict:
    import ctypes

    from lightning_dist.run.fit import fit

    # glibc serves allocations under its (adaptive, up to 32 MiB) mmap threshold from arenas it rarely returns, so
    # the peak RSS of a rank that all-gathers and frees FSDP units over and over would count freed buffers. A fixed
    # 64 KiB threshold (M_MMAP_THRESHOLD = -3) maps every tensor on its own: RSS follows what is alive.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)

    probe = _PeakMemory()
    fit(cfg, callbacks=(probe,))
    return probe.result


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cfg = compose_config([*FAST, *BIG, "parallelism=fsdp", "cluster.devices=1"], tmp_path_factory.mktemp("one"))
    one = launch(_fit, 1, cfg)[0]
    assert one["growth"] > 0.9 * one["model_bytes"]  # one process: the whole model, as the test's own baseline
    assert one["growth_after_step"] > 3.6 * one["model_bytes"]  # + gradients + AdamW moments
    return one


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=fsdp"],
        ["parallelism=tp_fsdp", "parallelism.tp=2"],
        # Each stage is sharded before it is materialized: a rank holds a quarter, never its whole stage.
        ["parallelism=pp", "parallelism.pipeline.split_points=[layers.4]"],
    ],
    ids=["fsdp4", "tp2xfsdp2", "pp2xfsdp2"],
)
def test_a_sharded_rank_holds_its_share_before_and_after_the_first_step(
    layout: list[str], one_process: dict, tmp_path: Path
) -> None:
    one, shards = one_process, 4
    overhead = max(0, one["growth"] - one["model_bytes"])  # what any run adds besides the parameters
    overhead_after = max(0, one["growth_after_step"] - 4 * one["model_bytes"])  # ... and activations, buffers
    for rank in launch(_fit, shards, compose_config([*FAST, *BIG, *layout, "cluster.devices=4"], tmp_path)):
        limit = one["model_bytes"] / shards + overhead + CONSTANT
        assert rank["growth"] < limit, (rank["growth"] / MB, limit / MB, one["growth"] / MB)
        # A pipeline stage keeps its FSDP2 units gathered through the step (reshard_after_forward=False: one
        # all-gather per step, not one per microbatch): its whole stage, beside its share, until the step ends.
        gathered = one["model_bytes"] / 2 - one["model_bytes"] / shards if "parallelism=pp" in layout else 0
        limit_after = 4 * one["model_bytes"] / shards + gathered + overhead_after + CONSTANT
        assert rank["growth_after_step"] < limit_after, (rank["growth_after_step"] / MB, limit_after / MB)
