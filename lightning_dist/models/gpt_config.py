"""GPTConfig: the built-in GPT's size and architecture (``model=gpt_tiny``, ``llama_8b``, ...), checked on its own.

Apart from :mod:`lightning_dist.models.gpt` so the config, the planner and the checkpoint code read it without the
model's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_dist.models.lora_config import LoraConfig

ARCHS = ("llama", "gpt2")
#: How a router turns its logits into expert scores: softmax over the experts (Mixtral, Qwen-MoE) or a sigmoid per
#: expert (DeepSeek-V3).
SCORE_FUNCS = ("softmax", "sigmoid")
#: How the experts are computed (:class:`lightning_dist.models.moe.GroupedExperts`): torch's grouped matrix multiply
#: where the device and dtype take it, else a loop over the experts (``auto``); or one of the two always.
EXPERT_COMPUTES = ("auto", "grouped_mm", "loop")


@dataclass
class MoEConfig:
    """A mixture of experts in place of the dense MLP (``model.moe.num_experts > 0``; lightning_dist/models/moe.py).

    Every token goes to ``top_k`` of ``num_experts`` SwiGLU experts (dropless: no token is dropped, so any layout
    computes the same thing), weighted by its router scores, plus the ``shared_experts`` every token takes.
    """

    num_experts: int = 0
    """Routed experts per MoE block; 0 = a dense model (no MoE)."""
    top_k: int = 2
    """Experts each token is routed to."""
    hidden: int | None = None
    """Hidden size of one expert; None = the dense MLP's (model.ffn_hidden or its default)."""
    shared_experts: int = 0
    """Experts every token also takes (DeepSeek, Qwen2-MoE): one SwiGLU of shared_experts x hidden; 0 = none."""
    dense_layers: int = 0
    """The first this many blocks keep the dense MLP (DeepSeek's first_k_dense_replace)."""
    score_func: str = "softmax"
    """Router scores: softmax over the experts (Mixtral, Qwen-MoE) or sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = True
    """Divide each token's top_k scores by their sum (Mixtral, Qwen3-MoE norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiply the (normalized) scores by this (DeepSeek-V3's routed_scaling_factor)."""
    balance_rate: float = 1e-3
    """Load balancing without an auxiliary loss (DeepSeek-V3, arXiv 2408.15664; torchtitan's load_balance_coeff):
    after each optimizer step every expert's routing bias moves by this much toward the mean load (up when it got
    fewer tokens than the mean over the global batch, down when more); the bias only picks experts, the scores stay
    unbiased. 0 = off."""
    aux_loss_coef: float = 0.0
    """Sequence-wise load-balancing loss (DeepSeek-V3's complementary loss; Switch Transformer's f x P taken per
    sequence): coef x E x sum_e f_e P_e averaged over the sequences, f_e the share of a sequence's routed tokens sent
    to expert e and P_e its mean (normalized) score. Per sequence, so any split of the batch over ranks and micro
    batches gives the same loss (not under parallelism.cp, which splits a sequence). Added to the gradient, logged
    as moe/aux_loss/<block> (train/loss stays the cross-entropy). 0 = off."""
    z_loss_coef: float = 0.0
    """Router z-loss (ST-MoE): coef x the mean over tokens of logsumexp(router logits)^2, keeping the logits small.
    Added to the gradient, logged as moe/z_loss/<block>. 0 = off."""
    expert_compute: str = "auto"
    """How the experts run: grouped_mm (torch's grouped matrix multiply, one kernel for all experts), loop (one
    matmul per expert: the reference) or auto (grouped_mm where the device and dtype take it: CUDA bf16 on SM 8.0+,
    CPU fp32 / bf16 with 16-byte aligned rows; else loop)."""

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE blocks."""
        return self.num_experts > 0

    def check_expert_parallel(self, ep: int) -> None:
        """Raise a one-line ``ValueError`` when ``parallelism.ep`` cannot split these experts (no MoE, or ``ep`` does
        not divide ``num_experts``)."""
        if ep > 1 and not self.enabled:
            raise ValueError(
                f"parallelism.ep={ep} but the GPT has no MoE blocks; set model.moe.num_experts (e.g. model=moe_tiny) "
                "or parallelism.ep=1."
            )
        if ep > 1 and self.num_experts % ep:
            divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(
                f"parallelism.ep={ep} does not divide the {self.num_experts} experts of each MoE block "
                f"(model.moe.num_experts); use an ep in {divisors}."
            )

    def validate(self, n_layers: int) -> None:
        """Raise a one-line ``ValueError`` naming the bad value and a fix."""
        if not self.enabled:
            if self.num_experts < 0:
                raise ValueError(f"model.moe.num_experts={self.num_experts} must be >= 0 (0 = a dense model).")
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} must be in [1, model.moe.num_experts={self.num_experts}].")
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"model.moe.hidden={self.hidden} must be positive; null = the dense MLP's hidden size.")
        if self.shared_experts < 0:
            raise ValueError(f"model.moe.shared_experts={self.shared_experts} must be >= 0.")
        if not 0 <= self.dense_layers < n_layers:
            raise ValueError(
                f"model.moe.dense_layers={self.dense_layers} must be in [0, model.n_layers={n_layers}): at least one "
                "block must be an MoE block (or set model.moe.num_experts=0 for a dense model)."
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"model.moe.score_func={self.score_func!r} is unknown; use one of {list(SCORE_FUNCS)}.")
        if self.route_scale <= 0:
            raise ValueError(f"model.moe.route_scale={self.route_scale} must be positive (1.0 = unscaled).")
        if self.balance_rate < 0:
            raise ValueError(f"model.moe.balance_rate={self.balance_rate} must be >= 0 (0 = no balancing).")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.moe.{name}={getattr(self, name)} must be >= 0 (0 = off).")
        if self.expert_compute not in EXPERT_COMPUTES:
            raise ValueError(
                f"model.moe.expert_compute={self.expert_compute!r} is unknown; use one of {list(EXPERT_COMPUTES)}."
            )


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
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts in place of the dense MLP (model.moe.num_experts > 0); off by default."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # read back from a checkpoint's hyperparameters (asdict)
            self.lora = LoraConfig(**self.lora)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a mixture of experts instead of the dense MLP."""
        return self.moe.enabled and index >= self.moe.dense_layers

    @property
    def expert_hidden(self) -> int:
        """Hidden size of one expert: ``moe.hidden`` or the dense MLP's."""
        return self.moe.hidden if self.moe.hidden is not None else self.hidden_dim

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
        if self.moe.enabled and self.arch != "llama":
            raise ValueError(
                f"model.moe.num_experts={self.moe.num_experts} with model.arch={self.arch!r}: the "
                "experts are SwiGLU (arch=llama); set model.arch=llama or model.moe.num_experts=0."
            )
        self.moe.validate(self.n_layers)


# ----------------------------------------------------------------------------------------------------- layers
