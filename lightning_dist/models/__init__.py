"""The reference GPT, its parallel plans and the LightningModules that train it and HuggingFace models.

``GPTConfig`` and ``LoraConfig`` are plain Python; the others need torch and are imported on first use (PEP 562), so
checking a config (which imports :mod:`.gpt_config` and :mod:`.optim_config`, and so this file first) does not import
torch.

LoRA in your own ``Trainer``: ``HFCausalLM(LlamaForCausalLM.from_pretrained(folder), lora=LoraConfig(rank=16))``
trains adapters on the frozen model (peft's layers, the optimizer holding the adapters only) under any strategy;
``GPTModule(GPTConfig(lora=LoraConfig(rank=16)), OptimConfig(), max_steps)`` on the built-in GPT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dist.lazy import lazy_exports
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.models.lora_config import LoraConfig

if TYPE_CHECKING:
    from lightning_dist.models.gpt import GPT
    from lightning_dist.models.hf import HFCausalLM
    from lightning_dist.models.module import GPTModule

#: Public name -> the module that defines it, imported on first use.
_LAZY = {
    "GPT": "lightning_dist.models.gpt",
    "GPTModule": "lightning_dist.models.module",
    "HFCausalLM": "lightning_dist.models.hf",
}

__all__ = ["GPT", "GPTConfig", "GPTModule", "HFCausalLM", "LoraConfig"]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
