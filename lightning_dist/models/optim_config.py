"""OptimConfig: the optimizer's settings (``optim.*`` in the config), plain Python.

Apart from :mod:`lightning_dist.models.optim`, which builds the optimizer with torch, so the config schema (and the
launcher that checks a config) reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases or embeddings)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr, reached at decay_steps."""
    decay_steps: int | None = None
    """Length of the warmup + cosine schedule; None = trainer.max_steps (set it to stop a run early)."""
