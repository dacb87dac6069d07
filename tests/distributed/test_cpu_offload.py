"""``parallelism.fsdp.cpu_offload=true``: FSDP2 keeps shards, gradients and optimizer state in host memory.

On this CPU-only machine the device is the host, so the copies FSDP2 makes are host to host: the test shows that
the policy reaches every FSDP2 unit (whole models and pipeline stages) and that the curve stays one process's.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from helpers import FAST, compose_config, losses, run_app

from lightning_dist.run.launch import launch


class _OffloadProbe(pl.Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

        from lightning_dist._compat import fsdp_offload_policy

        units = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self.result = {
            "units": len(units),
            "offloaded": sum(isinstance(fsdp_offload_policy(m), CPUOffloadPolicy) for m in units),
            "state_devices": sorted(
                {str(t.device) for state in trainer.optimizers[0].state.values() for t in state.values()}
            ),
        }


def _fit(cfg) -> dict:
    from lightning_dist.run.fit import fit

    probe = _OffloadProbe()
    result = fit(cfg, callbacks=(probe,))
    return {**probe.result, "history": result["history"]}


@pytest.mark.parametrize(
    "layout",
    [["parallelism=fsdp", "cluster.devices=2"], ["parallelism=pp", "cluster.devices=4"]],
    ids=["fsdp2", "pp2xfsdp2"],
)
def test_offloaded_shards_give_the_one_process_curve(layout: list[str], tmp_path: Path) -> None:
    reference = run_app([*FAST, "parallelism=fsdp", "cluster.devices=1"], tmp_path / "one")
    cfg = compose_config([*FAST, *layout, "parallelism.fsdp.cpu_offload=true"], tmp_path / "offload")
    for rank in launch(_fit, cfg.cluster.devices, cfg):
        assert rank["units"] > 0 and rank["offloaded"] == rank["units"]
        assert rank["state_devices"] == ["cpu"]
        np.testing.assert_allclose(losses(rank), losses(reference), rtol=1e-5)
        np.testing.assert_allclose(losses(rank, "train/grad_norm"), losses(reference, "train/grad_norm"), rtol=1e-5)


def test_offload_is_refused_without_shards() -> None:
    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"parallelism.fsdp.cpu_offload=true needs FSDP2 shards to offload"):
        validate(compose_config([*FAST, "parallelism=tp", "parallelism.fsdp.cpu_offload=true"]))
    with pytest.raises(ValueError, match=r"parallelism.fsdp.cpu_offload=true with parallelism=ddp"):
        validate(compose_config([*FAST, "parallelism.fsdp.cpu_offload=true"]))
