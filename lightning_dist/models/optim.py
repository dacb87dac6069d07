"""The optimizer the built-in modules use: AdamW with linear warmup and cosine decay (``optim.*`` in the config)."""

from __future__ import annotations

import math
from collections.abc import Callable
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


def warmup_cosine(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
