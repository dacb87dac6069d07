"""``parallelism.compile=true``: every block runs as an inductor graph (CPU: C++), with the eager one-process curve.

Compiled after TP and activation checkpointing and before FSDP2, in place: parameter names do not change, so plans,
checkpoints and pipeline splits keep working.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from helpers import FAST, compose_config, losses, run_app

from lightning_dist.run.launch import launch


class _CompileProbe(pl.Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch._dynamo.utils import counters

        self.result = {
            "compiled_blocks": [block._compiled_call_impl is not None for block in pl_module.model.layers.children()],
            "graphs": counters["stats"]["unique_graphs"],
            "names": sorted(name for name, _ in pl_module.named_parameters()),
        }


def _fit(cfg) -> dict:
    from lightning_dist.run.fit import fit

    probe = _CompileProbe()
    result = fit(cfg, callbacks=(probe,))
    return {**probe.result, "history": result["history"]}


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=fsdp", "parallelism.activation_checkpointing.mode=selective"],
        ["parallelism=pp"],
        ["parallelism=ddp"],  # the default layout: Lightning's DDP wraps the compiled blocks
    ],
    ids=["fsdp2-op-ac", "pp2", "ddp2"],
)
def test_compiled_blocks_give_the_eager_curve(layout: list[str], tmp_path: Path) -> None:
    eager = run_app([*FAST, "parallelism=fsdp", "cluster.devices=1"], tmp_path / "eager")
    cfg = compose_config([*FAST, *layout, "cluster.devices=2", "parallelism.compile=true"], tmp_path / "compiled")
    for rank in launch(_fit, 2, cfg):
        assert rank["graphs"] > 0 and all(rank["compiled_blocks"])  # the blocks this rank runs are graphs
        assert not any("_orig_mod" in name for name in rank["names"])  # compiled in place: names unchanged
        np.testing.assert_allclose(losses(rank), losses(eager), rtol=1e-5)
        np.testing.assert_allclose(losses(rank, "train/grad_norm"), losses(eager, "train/grad_norm"), rtol=1e-5)


def test_compile_is_refused_where_it_cannot_reach() -> None:
    from lightning_dist.config.validate import validate
    from lightning_dist.parallel.compose import compile_blocks

    with pytest.raises(ValueError, match=r"parallelism.compile=true with parallelism.tp=2: torch's compiled backward"):
        validate(compose_config([*FAST, "parallelism=tp", "parallelism.compile=true"]))
    with pytest.raises(ValueError, match=r"compile=true compiles the model's blocks one by one: define pipeline_spec"):
        compile_blocks([])
