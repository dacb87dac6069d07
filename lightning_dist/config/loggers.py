"""The ``logger`` group's rules, checked before launch: loggers are Lightning loggers built from ``_target_``.

As in lightning-hydra-template, ``logger`` is a mapping of names to nodes, each with a ``_target_`` (the logger's
import path) and its arguments: ``logger=wandb`` is ``{wandb: {_target_: lightning.pytorch.loggers.WandbLogger,
...}}``, ``logger=many`` several at once, ``+logger.<name>._target_=...`` any other. Each rank builds them
(:mod:`lightning_dist.run.loggers`); the launcher only checks that each node names a class whose package is installed,
without importing Lightning.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: The flat ``logger.*`` fields of versions before 0.4 -> where each lives now.
MOVED = {
    field: f"logger.wandb.{field}" for field in ("project", "entity", "group", "name", "tags", "mode", "log_model")
}

#: A logger class's name -> the import names of the packages it needs (any one of them) and how to install it.
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "WandbLogger": (("wandb",), "pip install 'lightning-dist[app]'"),
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "pip install 'lightning-dist[loggers]'"),
    "MLFlowLogger": (("mlflow",), "pip install 'lightning-dist[loggers]'"),
    "CometLogger": (("comet_ml",), "pip install comet-ml"),
    "NeptuneLogger": (("neptune",), "pip install neptune"),
}


def moved_key(key: str) -> str | None:
    """The one-line fix for a ``logger.<key>`` of the old flat schema (``logger.project=x``), else ``None``."""
    name = key.removeprefix("logger.")
    if name == "kind":
        return "logger.kind is gone: choose the logger group, logger=wandb|csv|tensorboard|mlflow|many|none"
    if name in MOVED:
        return f"logger.{name} moved: use {MOVED[name]}"
    return None


def is_wandb(node: Any) -> bool:
    """Whether a logger node builds a W&B logger (Lightning's ``WandbLogger`` or a class named like it)."""
    return isinstance(node, dict) and str(node.get("_target_", "")).endswith("WandbLogger")


def check_loggers(loggers: dict[str, Any]) -> None:
    """Each logger node has a ``_target_``, and the package its class needs is installed.

    Raises:
        ValueError: One line naming the node and the fix.
    """
    for name, node in loggers.items():
        if not isinstance(node, dict):
            fix = moved_key(name) or f"logger.{name}={node!r} is not a logger: give it a _target_ and its arguments"
            raise ValueError(fix)
        target = node.get("_target_")
        if not isinstance(target, str) or "." not in target:
            raise ValueError(
                f"logger.{name} has no _target_ (its class's import path); give "
                f"+logger.{name}._target_=lightning.pytorch.loggers.CSVLogger (or TensorBoardLogger, ...) and its "
                "arguments, or choose logger=wandb|csv|tensorboard|mlflow|many|none."
            )
        if importlib.util.find_spec(target.split(".")[0]) is None:  # the top package only: no import (start-up)
            raise ValueError(f"logger.{name}._target_={target!r}: package {target.split('.')[0]!r} is not installed.")
        packages, install = NEEDS.get(target.rsplit(".", 1)[-1], ((), ""))
        if packages and all(importlib.util.find_spec(package) is None for package in packages):
            raise ValueError(f"logger.{name} ({target.rsplit('.', 1)[-1]}) needs {packages[0]}: {install}")
