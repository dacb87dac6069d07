"""OptimConfig: the optimizer's settings (``optim.*`` in the config), plain Python.

Apart from :mod:`lightning_dist.models.optim`, which builds the optimizer with torch, so the config schema (and the
launcher that checks a config) reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``optim.schedule`` values: the LR schedules after the linear warmup.
LR_SCHEDULES = ("cosine", "wsd")


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then a cosine decay or a warmup-stable-decay schedule."""

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
    """Decay floor as a fraction of lr, reached at the schedule's end (decay_steps)."""
    decay_steps: int | None = None
    """Length of the schedule (warmup included); None = trainer.max_steps (set it to stop a run early)."""
    schedule: str = "cosine"
    """After the warmup: cosine (decay to min_lr_ratio over the rest of the schedule: every step's rate depends on its
    length, so a run continued longer keeps its length, optim.decay_steps) or wsd (warmup-stable-decay, as
    transformers' get_wsd_schedule: the peak rate, then a cosine decay over the last decay_fraction of the steps; a
    run continued longer from a checkpoint before the decay extends the stable phase, its steps unchanged)."""
    decay_fraction: float = 0.2
    """wsd: the part of the schedule's steps, at its end, spent decaying to min_lr_ratio x lr."""

    def validate(self) -> None:
        """Each field in its range, named as the config field (``optim.lr``), before any process starts.

        Raises:
            ValueError: One line naming the field, its value and what it must be.
        """
        rules = {
            "lr": (self.lr >= 0, ">= 0 (the peak learning rate)"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "beta1": (0 <= self.beta1 < 1, "in [0, 1)"),
            "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
            "eps": (self.eps >= 0, ">= 0"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1] (a fraction of optim.lr)"),
            "decay_steps": (self.decay_steps is None or self.decay_steps >= 1, ">= 1, or null (trainer.max_steps)"),
            "schedule": (self.schedule in LR_SCHEDULES, f"one of {', '.join(LR_SCHEDULES)}"),
            "decay_fraction": (0 < self.decay_fraction <= 1, "in (0, 1] (a fraction of the schedule's steps)"),
        }
        for name, (ok, needed) in rules.items():
            if not ok:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be {needed}.")
