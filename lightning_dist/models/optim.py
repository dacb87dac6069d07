"""The optimizer the built-in modules use: AdamW with linear warmup and cosine decay (``optim.*`` in the config)."""

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
    or what ``is_embedding`` names), stepped per optimizer step by the warmup + cosine schedule over ``max_steps``
    (warmup then the peak rate when the length is unknown, ``max_steps <= 0``)."""
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
    factor = warmup_cosine(cfg, max_steps) if max_steps > 0 else warmup_only(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
