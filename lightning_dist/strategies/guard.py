"""The non-finite guard: an optimizer step whose gradient norm is NaN or Inf is never applied.

The norm is taken over every axis after the last micro batch's backward, so every rank sees the same value and
takes the same decision without another collective. A NaN loss makes a NaN gradient, so the loss is covered too.
``stop`` (the default) ends the run with one line naming the step and the values; nothing of that step is applied
or saved, so the newest checkpoint is still a good one. ``skip`` drops the update and trains on (the step still
counts, for the LR schedule and ``max_steps``, as a skipped fp16 loss-scaler step does).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_dist.errors import NonFiniteError  # defined with the other errors; importable from here as before


def allow_step(norm: Tensor, loss: Any, action: str, module: pl.LightningModule) -> bool:
    """Whether the optimizer may apply this step's gradients.

    Raises:
        NonFiniteError: The norm is not finite and ``action`` is ``stop``.
    """
    if bool(torch.isfinite(norm)):
        return True
    step = module.trainer.global_step + 1
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    loss_text = f"{float(loss):.6g}" if isinstance(loss, Tensor) else "-"
    if action == "skip":
        rank_zero_warn(f"step {step}: gradient norm {float(norm)} (loss {loss_text}); the update was skipped.")
        return False
    raise NonFiniteError(
        f"step {step}: gradient norm {float(norm)} (loss {loss_text}) is not finite; the update was not applied and "
        "nothing of this step was saved. Lower optim.lr or raise the warmup, or set trainer.on_nonfinite=skip to "
        "drop such steps."
    )
