"""Data pipeline: synthetic Markov chain, byte-level text, token files and your own text with the model's tokenizer
(data=hf), sharded by data-parallel rank.

``DataConfig`` is plain Python; the rest needs torch and Lightning and is imported on first use (PEP 562), so checking
a config does not import them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_dist.data.config import DataConfig

if TYPE_CHECKING:
    from lightning_dist.data.datamodule import TokenDataModule, build_datamodule
    from lightning_dist.data.synthetic import MarkovChain

#: Public name -> the module that defines it, imported on first use.
_LAZY = {
    "MarkovChain": "lightning_dist.data.synthetic",
    "TokenDataModule": "lightning_dist.data.datamodule",
    "build_datamodule": "lightning_dist.data.datamodule",
}

__all__ = ["DataConfig", "MarkovChain", "TokenDataModule", "build_datamodule"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
