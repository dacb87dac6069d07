"""Data pipeline: synthetic Markov chain, byte-level text, token files and your own text with the model's tokenizer
(data=hf), sharded by data-parallel rank.

``DataConfig`` is plain Python; the rest needs torch and Lightning and is imported on first use (PEP 562), so checking
a config does not import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dist.data.config import DataConfig
from lightning_dist.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
