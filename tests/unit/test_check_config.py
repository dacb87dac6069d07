"""What the app settles before any process starts: machine-dependent values and the layout it hands the ranks."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist import MeshStrategy, ParallelDims
from lightning_dist.config.build import build_strategy
from lightning_dist.config.validate import validate
from lightning_dist.parallel.options import PipelineOptions


def test_accelerator_auto_means_cpu_without_cuda() -> None:
    cfg = compose_config([*FAST, "cluster.accelerator=auto"])
    cfg = validate(cfg).cfg
    assert cfg.cluster.accelerator == ("gpu" if torch.cuda.is_available() else "cpu")


def test_the_progress_bar_follows_the_terminal_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for isatty in (False, True):
        monkeypatch.setattr(sys.stdout, "isatty", lambda isatty=isatty: isatty)
        cfg = compose_config(FAST)
        cfg = validate(cfg).cfg
        assert cfg.trainer.enable_progress_bar is isatty
    cfg = compose_config([*FAST, "trainer.enable_progress_bar=true"])
    cfg = validate(cfg).cfg  # stdout is still a "terminal": an explicit choice is kept either way
    assert cfg.trainer.enable_progress_bar is True
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = compose_config([*FAST, "trainer.enable_progress_bar=false"])
    cfg = validate(cfg).cfg
    assert cfg.trainer.enable_progress_bar is False


def test_the_strategy_gets_the_layout_and_options_validate_built() -> None:
    full, skip = "parallelism.activation_checkpointing.mode=full", "resilience.on_nonfinite=skip"
    cfg = compose_config([*FAST, "parallelism=pp", "cluster.devices=4", "parallelism.dp_shard=2", full, skip])
    valid = validate(cfg)
    dims = valid.dims
    strategy = build_strategy(valid.cfg, dims)
    assert isinstance(strategy, MeshStrategy)
    assert strategy.parallel_dims is dims and strategy.parallelism is valid.parallelism
    assert (dims.pp, dims.dp_shard, dims.tp) == (2, 2, 1)
    assert (valid.parallelism.activation_checkpointing.mode, strategy.nonfinite_guard.action) == ("full", "skip")
    assert valid.parallelism.pipeline.num_microbatches(dims.pp) == 2  # pp x stages_per_rank


def test_validate_returns_a_resolved_copy_and_leaves_its_input_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    cfg = compose_config([*FAST, "parallelism=pp", "cluster.devices=2", "cluster.accelerator=auto",
                          "trainer.accumulate_grad_batches=2"])  # fmt: skip
    before = copy.deepcopy(cfg)
    valid = validate(cfg)
    assert cfg == before  # nothing resolved in place
    resolved = valid.cfg
    assert resolved.cluster.accelerator in ("cpu", "gpu") and resolved.trainer.enable_progress_bar is False
    assert (resolved.trainer.accumulate_grad_batches, resolved.parallelism.pipeline.microbatches) == (1, 2)
    assert validate(resolved).cfg == resolved  # resolving a resolved config changes nothing


def test_options_are_frozen_and_name_an_unknown_field() -> None:
    options = PipelineOptions(schedule="gpipe", split_points=["layers.1"])
    assert (options.schedule, options.split_points) == ("GPipe", ("layers.1",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.schedule = "1F1B"  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"^scheduel is not a parallelism option; the options are "):
        MeshStrategy(pp=2, scheduel="GPipe")
    with pytest.raises(ValueError, match=r"^on_nonfinite='ignore' is unknown"):
        MeshStrategy(on_nonfinite="ignore")


def test_a_layout_for_another_world_size_fails_before_launch() -> None:
    strategy = MeshStrategy(parallel_dims=ParallelDims(4, tp=2))
    strategy.num_nodes, strategy.parallel_devices = 1, [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match=r"laid out for world_size=4 but the Trainer runs 2 processes"):
        strategy.before_launch()
