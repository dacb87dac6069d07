"""GPTConfig: the built-in GPT's size and architecture (``model=gpt_tiny``, ``llama_8b``, ...), checked on its own.

Apart from :mod:`lightning_dist.models.gpt` so the config, the planner and the checkpoint code read it without the
model's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_dist.models.lora_config import LoraConfig

ARCHS = ("llama", "gpt2")


@dataclass
class GPTConfig:
    """Shape of the GPT. Defaults are a tiny model that trains on a laptop CPU."""

    arch: str = "llama"
    """llama (RMSNorm, RoPE, SwiGLU, no biases) or gpt2 (LayerNorm, learned positions, GELU MLP, biases)."""
    vocab_size: int = 256
    """Number of token ids the embedding and the output head cover."""
    n_layers: int = 2
    """Number of transformer blocks."""
    d_model: int = 64
    """Width of the residual stream (hidden size)."""
    n_heads: int = 4
    """Number of attention (query) heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Number of key/value heads; None = n_heads; fewer = grouped-query attention (must divide n_heads)."""
    ffn_hidden: int | None = None
    """MLP hidden size; None = llama: 8/3*d_model rounded up to multiple_of, gpt2: 4*d_model."""
    multiple_of: int = 32
    """The default llama MLP hidden size is rounded up to a multiple of this."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the RoPE tables / position embedding)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only); Llama 3 uses 500000."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorm / LayerNorm denominators."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization (output projections are scaled by 1/sqrt(2*n_layers))."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (LoRA) trained on the frozen model: model.lora.rank=16 (0 = every weight trained)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # read back from a checkpoint's hyperparameters (asdict)
            self.lora = LoraConfig(**self.lora)

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads, resolved (``n_kv_heads`` or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """MLP hidden size, resolved from ``ffn_hidden`` or the architecture's default."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.arch == "gpt2":
            return 4 * self.d_model
        hidden = int(8 / 3 * self.d_model)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        """Raise a one-line ``ValueError`` naming the bad value and a fix."""
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is unknown; use one of {list(ARCHS)}.")
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"model.{name}={value} must be a positive integer.")
        if self.d_model % self.n_heads:
            divisors = [d for d in range(1, min(self.d_model, 64) + 1) if self.d_model % d == 0]
            raise ValueError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}; "
                f"pick a divisor such as {' or '.join(map(str, divisors[-2:]))}."
            )
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(
                f"model.d_model={self.d_model} / model.n_heads={self.n_heads} = head_dim {self.head_dim} is odd; "
                "RoPE needs an even head_dim: change d_model or n_heads."
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}; "
                f"use one of {divisors} (or null for n_heads)."
            )
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden} must be positive; set it to null for the default.")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be positive, e.g. 10000.0 or 500000.0.")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps={self.norm_eps} must be positive, e.g. 1e-5.")
        if self.init_std <= 0:
            raise ValueError(f"model.init_std={self.init_std} must be positive, e.g. 0.02.")
        self.lora.check()


# ----------------------------------------------------------------------------------------------------- layers
