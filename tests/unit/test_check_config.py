"""What the app settles before any process starts: machine-dependent values and the layout it hands the ranks."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist import MeshStrategy, ParallelDims
from lightning_dist.app import build_strategy, check_config


def test_accelerator_auto_means_cpu_without_cuda() -> None:
    cfg = compose_config([*FAST, "cluster.accelerator=auto"])
    check_config(cfg)
    assert cfg.cluster.accelerator == ("gpu" if torch.cuda.is_available() else "cpu")


def test_the_progress_bar_follows_the_terminal_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for isatty in (False, True):
        monkeypatch.setattr(sys.stdout, "isatty", lambda isatty=isatty: isatty)
        cfg = compose_config(FAST)
        check_config(cfg)
        assert cfg.trainer.enable_progress_bar is isatty
    cfg = compose_config([*FAST, "trainer.enable_progress_bar=true"])
    check_config(cfg)  # stdout is still a "terminal": an explicit choice is kept either way
    assert cfg.trainer.enable_progress_bar is True
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = compose_config([*FAST, "trainer.enable_progress_bar=false"])
    check_config(cfg)
    assert cfg.trainer.enable_progress_bar is False


def test_the_strategy_gets_the_layout_check_config_built() -> None:
    cfg = compose_config([*FAST, "parallelism=pp", "cluster.devices=4", "parallelism.dp_shard=2"])
    dims = check_config(cfg)
    strategy = build_strategy(cfg, dims)
    assert isinstance(strategy, MeshStrategy)
    assert strategy.parallel_dims is dims
    assert (dims.pp, dims.dp_shard, dims.tp) == (2, 2, 1)


def test_a_layout_for_another_world_size_fails_before_launch() -> None:
    strategy = MeshStrategy(parallel_dims=ParallelDims(4, tp=2))
    strategy.num_nodes, strategy.parallel_devices = 1, [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match=r"laid out for world_size=4 but the Trainer runs 2 processes"):
        strategy.before_launch()
