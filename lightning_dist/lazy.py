"""Package exports imported on first use (PEP 562), shared by the packages the launcher must import without torch.

A package's ``__init__`` names its exports and their modules; ``lazy_exports`` returns the module-level
``__getattr__`` and ``__dir__`` that import a module the first time one of its names is read (and keep the value).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: dict[str, Any], table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose globals are ``package`` and whose ``table`` maps each lazy
    name to the module that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        package[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*package, *table})

    return __getattr__, __dir__
