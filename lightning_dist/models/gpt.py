"""A reference decoder-only transformer (GPT), readable top to bottom. No distributed code.

Two architectures share one set of module names:

- ``arch="llama"``: RMSNorm, rotary position embeddings (RoPE), SwiGLU MLP, no biases, optional grouped-query
  attention (``n_kv_heads < n_heads``).
- ``arch="gpt2"``: LayerNorm with bias, learned absolute position embedding, GELU MLP, biases everywhere except
  the output head.

The module names are a contract that the tensor-parallel plan and the pipeline splitter rely on
(see ``gpt_parallel.py``)::

    GPT
    ├── tok_emb            nn.Embedding(vocab_size, d_model)
    ├── pos_emb            nn.Embedding(max_seq_len, d_model)   (gpt2 only, else None)
    ├── layers             nn.ModuleDict {"0": Block, ..., "L-1": Block}
    │   └── Block
    │       ├── attn_norm  RMSNorm | LayerNorm
    │       ├── attn       Attention: q_proj, k_proj, v_proj, o_proj
    │       ├── mlp_norm   RMSNorm | LayerNorm
    │       └── mlp        MLP: gate_proj (llama only), up_proj, down_proj
    │           or moe     MoE: router, experts, shared (model.moe.num_experts > 0: see moe.py)
    ├── norm               RMSNorm | LayerNorm
    └── head               nn.Linear(d_model, vocab_size, bias=False)

Shapes in comments: B batch, T sequence length, C ``d_model``, H query heads, K key/value heads, D ``head_dim``,
F the MLP hidden size, V ``vocab_size``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dist.models.gpt_config import ARCHS, GPTConfig, MoEConfig
from lightning_dist.models.moe import MoE
from lightning_dist.models.whole import copy_whole

__all__ = ["ARCHS", "GPT", "GPTConfig", "MoEConfig"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in float32.

    Args:
        dim: Size of the last dimension.
        eps: Added to the mean square before the square root.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the scale to one."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()  # (B, T, C)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).type_as(x)


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The architecture's normalization layer over ``d_model``."""
    if cfg.arch == "gpt2":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    return RMSNorm(cfg.d_model, eps=cfg.norm_eps)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Cosine and sine of the rotary angles, in float32.

    Position ``t`` rotates the pair ``(x[i], x[i + D/2])`` by the angle ``t * theta ** (-2i / D)``.

    Args:
        head_dim: Width D of one head (even).
        max_seq_len: Number of positions.
        theta: Base frequency.
        device: Where to build the tables (None = the current default device).

    Returns:
        ``(cos, sin)``, each of shape (max_seq_len, head_dim // 2).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (D/2,)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)  # (T_max,)
    angles = torch.outer(positions, inv_freq)  # (T_max, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first and second halves of each head of ``x`` by the position's angles (positions 0..T-1).

    Real-valued (no complex tensors, so the tables can be broadcast by any backend).

    Args:
        x: Queries or keys, shape (B, T, heads, D).
        cos: Cosine table, shape (>= T, D/2).
        sin: Sine table, shape (>= T, D/2).

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    T = x.shape[1]
    if cos.shape[0] < T:
        raise ValueError(f"sequence length {T} exceeds model.max_seq_len={cos.shape[0]}; raise model.max_seq_len.")
    cos = cos[:T].to(x.dtype)[None, :, None, :]  # (1, T, 1, D/2)
    sin = sin[:T].to(x.dtype)[None, :, None, :]  # (1, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, heads, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, heads, D)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal scaled dot-product attention; ``k`` / ``v`` may have fewer heads than ``q`` (grouped-query attention).

    Args:
        q: Queries, shape (B, H, T, D).
        k: Keys, shape (B, K, T, D), K dividing H.
        v: Values, shape (B, K, T, D).

    Returns:
        Shape (B, H, T, D).
    """
    groups = q.shape[1] // k.shape[1]  # query heads per key/value head
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)


class Attention(nn.Module):
    """Causal multi-head self-attention with optional grouped-query attention and RoPE.

    Head counts are read from the projected tensors at run time, so a column-sharded ``q_proj`` / ``k_proj`` /
    ``v_proj`` (whole heads per rank, as tensor parallelism does) works unchanged. The attention itself is the
    attribute ``attention_fn`` (:func:`causal_attention`), so that code outside the model (context parallelism) can
    put another one with the same signature in its place.

    Args:
        cfg: Model configuration.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        bias = cfg.arch == "gpt2"
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=bias)
        self.attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention

    def forward(self, x: Tensor, rope_cos: Tensor | None = None, rope_sin: Tensor | None = None) -> Tensor:
        """Attend over the sequence.

        Args:
            x: Normalized hidden states, shape (B, T, C).
            rope_cos: RoPE cosine table (T_max, D/2), or None for no rotation (gpt2).
            rope_sin: RoPE sine table (T_max, D/2), or None.

        Returns:
            Shape (B, T, C).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        if rope_cos is not None and rope_sin is not None:
            q = apply_rope(q, rope_cos, rope_sin)
            k = apply_rope(k, rope_cos, rope_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        y = self.attention_fn(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.o_proj(y)  # (B, T, C)


class MLP(nn.Module):
    """Feed-forward sub-layer: SwiGLU ``down(silu(gate(x)) * up(x))`` for llama, ``down(gelu(up(x)))`` for gpt2.

    Args:
        cfg: Model configuration.
        hidden: The hidden size F; ``None`` = ``cfg.hidden_dim`` (the shared experts of an MoE block take another).
    """

    def __init__(self, cfg: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        bias = not self.swiglu
        hidden = cfg.hidden_dim if hidden is None else hidden
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, F)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")  # (B, T, F)
        return self.down_proj(h)  # (B, T, C)


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (``moe`` in place of ``mlp``
    in an MoE block).

    Args:
        cfg: Model configuration.
        index: The block's place in the model (the first ``model.moe.dense_layers`` stay dense).
    """

    def __init__(self, cfg: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp: MLP | None = None
        self.moe: MoE | None = None
        if cfg.is_moe_layer(index):
            shared = MLP(cfg, cfg.moe.shared_experts * cfg.expert_hidden) if cfg.moe.shared_experts else None
            self.moe = MoE(cfg, shared)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope_cos: Tensor | None = None, rope_sin: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope_cos, rope_sin)  # (B, T, C)
        ffn = self.mlp if self.mlp is not None else self.moe
        x = x + ffn(self.mlp_norm(x))  # (B, T, C)
        return x


# -------------------------------------------------------------------------------------------------------- GPT
class GPT(nn.Module):
    """Decoder-only transformer language model.

    A pipeline stage is this model with some entries of ``layers`` deleted and, outside the first stage,
    ``tok_emb`` / ``pos_emb`` set to None (the stage then takes hidden states), and outside the last stage
    ``norm`` / ``head`` set to None (the stage then returns hidden states).

    Args:
        config: Model configuration (validated here).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = None
        if config.arch == "gpt2":
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm: nn.Module | None = make_norm(config)
        self.head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()

        # RoPE tables: derived values, not state (non-persistent: not in checkpoints, recomputed after to_empty).
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.reset_rope_buffers()

        if not next(self.parameters()).is_meta:
            self.init_weights(0)

    def tie_weights(self) -> None:
        """Make ``head.weight`` the token embedding's matrix when ``tie_embeddings`` is set and both exist."""
        if self.config.tie_embeddings and self.tok_emb is not None and self.head is not None:
            self.head.weight = self.tok_emb.weight  # also re-ties after to_empty, which gives each its own tensor

    def reset_rope_buffers(self) -> None:
        """(Re)compute the RoPE tables in float32 on the buffers' device (llama only).

        Called from ``__init__`` and from :meth:`init_weights`, so a model built on the meta device and then
        materialized with ``to_empty`` gets real tables again.
        """
        if self.config.arch != "llama":
            return
        device = self.rope_cos.device if self.rope_cos is not None else None
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin  # (T_max, D/2) each

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter deterministically from ``seed`` and its name.

        Each parameter gets its own CPU generator seeded with ``zlib.crc32(f"{seed}:{name}")``, draws in float32
        on the CPU, and is copied into place. So the values depend only on (seed, name, shape): a whole model, a
        pipeline stage built alone and a model materialized from the meta device agree for every name they share,
        whatever the dtype or device. Weights are ``N(0, init_std)``; ``o_proj`` / ``down_proj`` weights (the
        experts' too) use ``init_std / sqrt(2 * n_layers)`` (GPT-2); norm scales are one and biases zero. With tied
        embeddings a stage holding only ``head`` draws it under the name ``tok_emb.weight``, like the whole model
        does. The routers' balancing biases start at zero.

        Args:
            seed: Base seed.
        """
        self.tie_weights()
        self.reset_rope_buffers()
        for name, buffer in self.named_buffers():
            if name.endswith(("router.expert_bias", "router.tokens_per_expert", "router.loss_sums")):
                buffer.zero_()  # after to_empty (a meta-device build) they hold whatever the memory held
        cfg = self.config
        for name, param in self.named_parameters():
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, (RMSNorm, nn.LayerNorm)) and param_name == "weight":
                value = torch.ones(param.shape, device="cpu")
            elif param_name == "bias":
                value = torch.zeros(param.shape, device="cpu")
            else:
                std = cfg.init_std
                if module_name.endswith(("o_proj", "down_proj")) or name.endswith("experts.down_proj"):
                    std = std / math.sqrt(2 * cfg.n_layers)
                key = "tok_emb.weight" if cfg.tie_embeddings and name == "head.weight" else name
                generator = torch.Generator(device="cpu")
                # One string hashed: the CPU generator keeps only 32 bits of its seed.
                generator.manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
                value = torch.nn.init.normal_(torch.empty(param.shape, device="cpu"), 0.0, std, generator=generator)
            copy_whole(param, value)

    def forward(self, x: Tensor, *, logits: bool = True) -> Tensor:
        """Run the (remaining) model.

        Args:
            x: Token ids (B, T) long when ``tok_emb`` is present, else hidden states (B, T, C).
            logits: Apply ``head``; ``False`` returns the final normalized hidden states instead, for a loss that
                applies the head itself (``models/loss.py: chunked_token_loss``, which never builds all the logits).

        Returns:
            Logits (B, T, V) when ``head`` is present (and ``logits``), else hidden states (B, T, C).
        """
        T = x.shape[1]
        if self.config.max_seq_len < T:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.config.max_seq_len}.")
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=x.device))  # (B, T, C)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)  # (B, T, C)
        if self.norm is not None:
            x = self.norm(x)  # (B, T, C)
        if self.head is not None and logits:
            x = self.head(x)  # (B, T, V)
        return x

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Number of parameters held by this module (a shared tensor is counted once).

        Args:
            exclude_embedding: Leave out the token and position embeddings. With tied embeddings the shared
                matrix is kept, as it also serves as the output head (nanoGPT's convention).

        Returns:
            The parameter count.
        """
        skip: set[int] = set()
        if exclude_embedding:
            for emb in (self.tok_emb, self.pos_emb):
                if emb is not None:
                    skip.add(id(emb.weight))
            if self.head is not None:
                skip.discard(id(self.head.weight))
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def num_active_params(self, exclude_embedding: bool = True) -> int:
        """Parameters one token passes through: :meth:`num_params` less the routed experts it does not take
        (``num_experts - top_k`` of them in each MoE block held)."""
        moe = self.config.moe
        idle = 0
        for layer in self.layers.values():
            if layer.moe is not None:
                per_expert = sum(p[0].numel() for p in layer.moe.experts.parameters())
                idle += (moe.num_experts - moe.top_k) * per_expert
        return self.num_params(exclude_embedding) - idle

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate.

        ``6 * N + 12 * L * H * Q * T``: N non-embedding parameters a token passes through (``num_active_params()``:
        of an MoE block, its ``top_k`` experts), L layers held, H heads, Q head dim, T ``seq_len``. The second term
        is the attention score and value matmuls.

        Args:
            seq_len: Training sequence length T.

        Returns:
            FLOPs per token.
        """
        cfg = self.config
        n = self.num_active_params(exclude_embedding=True)
        return 6 * n + 12 * len(self.layers) * cfg.n_heads * cfg.head_dim * seq_len
