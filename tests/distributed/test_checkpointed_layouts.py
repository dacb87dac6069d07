"""Activation checkpointing under real layouts (whole models and pipeline stages): the one-process curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, assert_planned, losses, run_app

REFERENCE = ["parallelism=fsdp", "cluster.devices=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *REFERENCE], tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=tp_fsdp", "cluster.devices=4", "parallelism.activation_checkpointing.mode=full"],
        ["parallelism=fsdp", "cluster.devices=2", "parallelism.activation_checkpointing.mode=selective"],
        ["parallelism=tp", "cluster.devices=2", "parallelism.activation_checkpointing.mode=selective"],
        [
            "parallelism=fsdp",
            "cluster.devices=2",
            "parallelism.activation_checkpointing.mode=selective",
            "parallelism.activation_checkpointing.selective=op_half",
        ],
        [
            "parallelism=pp",
            "cluster.devices=2",
            "parallelism.pipeline.microbatches=4",
            "parallelism.activation_checkpointing.mode=selective",
            "parallelism.activation_checkpointing.selective=op_half",
        ],
        [
            "parallelism=pp",
            "cluster.devices=2",
            "parallelism.pipeline.microbatches=2",
            "parallelism.activation_checkpointing.mode=selective",
            "parallelism.activation_checkpointing.selective=2",
        ],
        ["parallelism=ddp", "cluster.devices=2", "parallelism.activation_checkpointing.mode=full"],
    ],
    ids=["tp2xfsdp2-full", "fsdp2-op", "tp2-op", "fsdp2-op_half", "pp2-op_half", "pp2-every2", "ddp2-full"],
)
def test_checkpointed_layouts_match_one_process(layout: list[str], reference: dict, tmp_path: Path) -> None:
    result = run_app([*FAST, *layout], tmp_path)
    assert len(losses(result)) == 10
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    np.testing.assert_allclose(losses(result, "train/grad_norm"), losses(reference, "train/grad_norm"), rtol=1e-4)
    assert_planned(result)


def test_checkpointing_is_refused_where_it_cannot_reach() -> None:
    from helpers import compose_config

    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"parallelism.activation_checkpointing.mode='some' is unknown"):
        validate(compose_config([*FAST, "parallelism=fsdp", "parallelism.activation_checkpointing.mode=some"]))
