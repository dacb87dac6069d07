"""The optimizer the built-in modules use: AdamW with linear warmup, then cosine decay or warmup-stable-decay
(``optim.*`` in the config)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

# Also re-exported (optim.OptimConfig, its first home); the config schema imports optim_config, without torch.
from lightning_dist.models.optim_config import OptimConfig


def warmup_cosine(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def warmup_stable_decay(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """LR multiplier of transformers' ``get_wsd_schedule`` (cosine decay) after our linear warmup: the peak rate from
    the warmup to :func:`decay_start`, then a cosine decay to ``min_lr_ratio`` over the last ``decay_fraction`` of
    ``max_steps``. A longer schedule moves the decay: every step before the earlier start has the same rate."""
    start = decay_start(cfg, max_steps)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, max_steps - start))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def decay_start(cfg: OptimConfig, max_steps: int) -> int:
    """The first step of a warmup-stable-decay schedule's decay: the last ``decay_fraction`` of ``max_steps`` (at least
    a step), never inside the warmup."""
    decay = max(1, round(cfg.decay_fraction * max_steps))
    return max(cfg.warmup_steps, max_steps - decay)


def lr_factor(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """The LR multiplier of ``optim.schedule`` over a schedule of ``max_steps`` (the warmup, then the peak rate, when
    the length is unknown: ``max_steps <= 0``)."""
    if max_steps <= 0:
        return warmup_only(cfg)
    return warmup_stable_decay(cfg, max_steps) if cfg.schedule == "wsd" else warmup_cosine(cfg, max_steps)


def warmup_only(cfg: OptimConfig) -> Callable[[int], float]:
    """LR multiplier of a run of unknown length (by epochs): linear warmup, then the peak rate."""
    return lambda step: min(1.0, (step + 1) / max(1, cfg.warmup_steps))


def adamw_with_schedule(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    cfg: OptimConfig,
    is_embedding: Callable[[str, nn.Parameter], bool],
    max_steps: int,
) -> dict[str, Any]:
    """Lightning's ``configure_optimizers`` answer: AdamW with weight decay on matrices only (not on norms, biases
    or what ``is_embedding`` names), stepped per optimizer step by ``optim.schedule`` over ``max_steps``
    (:func:`lr_factor`)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (decay if param.ndim >= 2 and not is_embedding(name, param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        # An empty group (LoRA trains matrices only) would break torch's sharded optimizer state dict on load.
        [group for group in groups if group["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, max_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
