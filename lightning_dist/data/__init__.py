"""Data pipeline: synthetic Markov chain, byte-level text, token files and your own text with the model's tokenizer
(data=hf), sharded by data-parallel rank."""

from __future__ import annotations

from lightning_dist.data.config import DataConfig
from lightning_dist.data.datamodule import TokenDataModule, build_datamodule
from lightning_dist.data.synthetic import MarkovChain

__all__ = ["DataConfig", "MarkovChain", "TokenDataModule", "build_datamodule"]
