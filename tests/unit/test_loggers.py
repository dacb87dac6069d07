"""The W&B logger's fields come from the config or W&B's own environment variables, never hard-coded."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose_config

from lightning_dist.run.loggers import build_logger


def _init(overrides: list[str], folder: Path) -> dict:
    cfg = compose_config(["logger=wandb", *overrides])
    return build_logger(cfg.logger, folder, cfg)._wandb_init  # what WandbLogger hands wandb.init


def test_wandb_fields_come_from_the_config_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    init = _init(["logger.entity=team", "logger.group=g1", "logger.tags=[a,b]", "logger.mode=disabled"], tmp_path)
    assert (init["project"], init["entity"], init["group"], init["tags"]) == ("from-env", "team", "g1", ["a", "b"])
    assert init["mode"] == "disabled"  # the user's explicit choice
    assert init["name"] == f"gpt-llama-d64-L2 ddp {tmp_path.name}"  # model, layout, run folder
    assert _init(["logger.project=mine"], tmp_path)["project"] == "mine"  # the config over the environment
    monkeypatch.delenv("WANDB_PROJECT")
    plain = _init([], tmp_path)
    assert plain["project"] == "lightning-dist"
    assert "entity" not in plain and "group" not in plain  # W&B's own defaults (WANDB_ENTITY) apply
