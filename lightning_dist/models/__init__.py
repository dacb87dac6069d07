"""The reference GPT, its parallel plans and the LightningModule that trains it.

``GPTConfig`` is plain Python; ``GPT`` needs torch and is imported on first use (PEP 562), so checking a config
(which imports :mod:`.gpt_config` and :mod:`.optim_config`, and so this file first) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dist.lazy import lazy_exports
from lightning_dist.models.gpt_config import GPTConfig

if TYPE_CHECKING:
    from lightning_dist.models.gpt import GPT

#: Public name -> the module that defines it, imported on first use.
_LAZY = {"GPT": "lightning_dist.models.gpt"}

__all__ = ["GPT", "GPTConfig"]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
