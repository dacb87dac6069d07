"""LoraConfig: ``model.lora.*``, low-rank adapters trained on a frozen model (``models/lora.py`` applies them).

Apart from :mod:`lightning_dist.models.lora` so the config and the planner read it without torch or peft.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``model.lora.quantize`` values (QLoRA: the frozen base weights stored in 4 bits, ``models/qlora.py``).
QUANTIZE = ("nf4",)
#: torchao's NF4 block sizes (QLoRA's): a scale per 64 values, the scales quantized in groups of 256.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
#: Bytes an NF4 value costs: 4 bits, an int8 scale per block, an fp32 factor per group of scales.
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, through peft): the model's weights frozen, a pair of small matrices trained beside each
    targeted linear layer (``W x + (alpha / rank) * B A x``). ``rank: 0`` trains every weight (no LoRA)."""

    rank: int = 0
    """Rank r of each adapter (its A is r x in, its B out x r); 0 = no LoRA, every weight trained."""
    alpha: float = 16.0
    """Scale numerator: an adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input (not on the frozen layer's); 0 keeps every layout on the one-process curve."""
    targets: list[str] | None = None
    """The linear layers adapted, by name or name suffix (q_proj, v_proj; peft's rule); None = every linear layer of
    the decoder blocks (attention and MLP projections; not the embedding or the output head)."""
    quantize: str | None = None
    """QLoRA: the frozen linear weights of the blocks stored in 4 bits (nf4: torchao's NormalFloat, double-quantized
    scales), computed with dequantized; the embedding, head and norms keep their dtype; None = the run's precision."""

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (``rank > 0``)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """What an adapter's ``B A x`` is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank

    def check(self) -> None:
        """Raise a one-line ``ValueError`` for a value that cannot run (before any process starts)."""
        if self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank} is negative; use 0 (no LoRA) or a rank such as 8 or 16.")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"model.lora.quantize={self.quantize!r} is unknown; use one of {QUANTIZE} or null.")
        if not self.enabled:
            if self.quantize is not None:
                raise ValueError(
                    f"model.lora.quantize={self.quantize} (QLoRA) quantizes the frozen base under LoRA adapters: set "
                    "model.lora.rank (e.g. 16), or model.lora.quantize=null to train every weight."
                )
            return
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha={self.alpha} must be positive (often 2 x rank: {2 * self.rank}).")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1).")
        if self.targets is not None and not self.targets:
            raise ValueError("model.lora.targets=[] adapts nothing; name layers (q_proj, v_proj) or null for all.")
