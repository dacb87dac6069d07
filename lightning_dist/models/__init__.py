"""The reference GPT, its parallel plans and the LightningModule that trains it."""

from lightning_dist.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
