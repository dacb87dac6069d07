"""``parallelism.tensor.plan``: a tensor-parallel plan given on the command line, read and checked before launch."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_dist.parallel.options import TP_STYLE_NAMES


def load_tp_plan(value: str | None) -> dict[str, Any] | None:
    """The plan ``parallelism.tensor.plan`` names: a YAML / JSON file of ``pattern: style``, or
    ``package.module:name`` of such a dict or of a function returning one (whose styles may also be torch
    ``ParallelStyle`` objects).

    Raises:
        ValueError: A file or object that is not there, not a mapping, or names an unknown style (one line).
    """
    if value is None:
        return None
    key = f"parallelism.tensor.plan={value}"
    path = Path(value).expanduser()
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise ValueError(f"{key}: no such file; give a YAML / JSON file of module pattern: style.")
        text = path.read_text()
        plan = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    elif ":" in value:
        module_name, _, attr = value.partition(":")
        try:
            plan = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{key}: cannot import it ({err}); give package.module:name of a dict.") from None
        plan = plan() if callable(plan) else plan
    else:
        raise ValueError(f"{key} is neither a YAML / JSON file nor package.module:name; give one of those.")
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"{key} holds a {type(plan).__name__}, not a mapping of module pattern -> style.")
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in TP_STYLE_NAMES:
            raise ValueError(
                f"{key}: style {style!r} of {pattern!r} is unknown; use one of {', '.join(TP_STYLE_NAMES)}."
            )
    return dict(plan)
