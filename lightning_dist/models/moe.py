"""Mixture of experts (MoE): a router sends each token to ``top_k`` of ``num_experts`` SwiGLU experts. No distributed
code: expert parallelism (``lightning_dist/parallel/expert.py``) wraps :class:`GroupedExperts` from outside.

The block, by module name (what checkpoints, the HuggingFace export and the layouts refer to)::

    MoE
    ├── router   Router: gate nn.Linear(C, E, bias=False); buffers expert_bias (E,), tokens_per_expert (E,)
    ├── experts  GroupedExperts: gate_proj (E, F, C), up_proj (E, F, C), down_proj (E, C, F)
    └── shared   MLP | None: the shared experts, one SwiGLU of width shared_experts x F that every token takes

Routing is dropless: every token reaches its ``top_k`` experts however unevenly they are chosen, so the block computes
the same thing whichever ranks hold which experts and tokens. The experts' interface is the one transformers' MoE
families use, ``experts(hidden (N, C), top_k_index (N, K), top_k_weights (N, K)) -> (N, C)`` with the weights of
expert ``e`` at index ``e`` of dim 0, so expert parallelism takes our experts and theirs alike.

Load balancing without an auxiliary loss (DeepSeek-V3; arXiv 2408.15664; torchtitan's ``load_balance_coeff``): each
router counts the tokens it sends to each expert in the step's trained forwards (in their backward); after the step's
last backward the counts are
summed over the data-parallel ranks (by the strategy: :func:`expert_load`) and :func:`update_expert_bias` moves each
expert's routing bias toward the mean load. The bias changes which experts are picked, never the weights they get.

Shapes in comments: N tokens (B x T), C ``d_model``, E experts, K ``top_k``, F an expert's hidden size, R = N x K
routed rows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dist import _compat
from lightning_dist.models.gpt_config import GPTConfig, MoEConfig


class Router(nn.Module):
    """Token-choice top-k routing: scores from a linear gate (softmax or sigmoid), the top ``k`` experts per token.

    Args:
        d_model: Width C of a token.
        moe: The MoE settings (experts, top_k, score function, normalization, balancing).
    """

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, moe.num_experts, bias=False)
        self.top_k = moe.top_k
        self.score_func = moe.score_func
        self.route_norm = moe.route_norm
        self.route_scale = moe.route_scale
        self.balance_rate = moe.balance_rate
        self.aux_loss_coef = moe.aux_loss_coef
        self.z_loss_coef = moe.z_loss_coef
        # The balancing bias is state (checkpointed); the counts are the current step's (summed, then reset), and so
        # are the sums of the step's balance and z losses with the number of forwards they came from (for logging).
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)
        self.register_buffer("loss_sums", torch.zeros(3), persistent=False)

    def forward(self, x: Tensor, batch_size: int = 1) -> tuple[Tensor, Tensor, Tensor | None]:
        """Pick experts for each token.

        Args:
            x: Tokens, shape (N, C): ``batch_size`` sequences of ``N / batch_size`` tokens, one after the other.
            batch_size: B, for the sequence-wise balance loss.

        Returns:
            ``(top_k_index, top_k_weights, losses)``: expert ids (N, K), their weights (N, K, float32), and the
            balance loss plus the z-loss (coefficients applied; 0-dim), or ``None`` when both are off or not training.
        """
        logits = self.gate(x).float()  # (N, E): scores in float32, as the balance of near-equal experts is fragile
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores + self.expert_bias if self.balance_rate > 0 else scores  # the bias picks, never weighs
        index = torch.topk(choice, self.top_k, dim=-1).indices  # (N, K)
        weights = scores.gather(-1, index)  # (N, K)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        if self.training and weights.requires_grad:
            # Counted when the backward reaches the weights: only forwards that are trained count (not a pipeline's
            # shape inference, nor the recomputed forward of activation checkpointing, nor validation).
            weights.register_hook(functools.partial(self._count, index.reshape(-1)))
        losses = None
        if self.training and (self.aux_loss_coef > 0 or self.z_loss_coef > 0):
            losses = self._balance_losses(logits, scores, index, batch_size)
        return index, weights, losses

    def _balance_losses(self, logits: Tensor, scores: Tensor, index: Tensor, batch_size: int) -> Tensor:
        """``aux_loss_coef x`` the sequence-wise balance loss plus ``z_loss_coef x`` the z-loss (see ``MoEConfig``);
        their values, and that one forward made them, are added to ``loss_sums`` when the backward passes."""
        N, E = scores.shape
        aux = z = logits.new_zeros(())
        if self.aux_loss_coef > 0:
            B, K = batch_size, self.top_k
            counts = torch.zeros(B, E, device=logits.device).scatter_add_(  # (B, E): routed tokens per sequence
                1, index.reshape(B, -1), torch.ones(B, (N // B) * K, device=logits.device)
            )
            f = counts * (E / (K * (N // B)))  # (B, E): 1 where a sequence's tokens are spread evenly
            p = (scores / scores.sum(-1, keepdim=True)).reshape(B, N // B, E).mean(1)  # (B, E)
            aux = self.aux_loss_coef * (f * p).sum(-1).mean()
        if self.z_loss_coef > 0:
            z = self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return LossSums.apply(aux + z, torch.stack([aux.detach(), z.detach()]), self.loss_sums)

    @torch.no_grad()
    def _count(self, experts: Tensor, grad: Tensor) -> None:
        self.tokens_per_expert.scatter_add_(0, experts, torch.ones_like(experts, dtype=self.tokens_per_expert.dtype))

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """Move each expert's bias by ``balance_rate`` toward the mean load (up if it got fewer tokens, down if more),
        centred so the biases keep a zero mean (torchtitan's update). ``load``: tokens per expert over the global
        batch of the step, shape (E,)."""
        if self.balance_rate > 0:
            delta = self.balance_rate * torch.sign(load.mean() - load)
            self.expert_bias.add_(delta - delta.mean())


class LossSums(torch.autograd.Function):
    """The identity on a loss; its backward adds ``values`` and a count of one to ``sums`` (a trained forward's
    balance and z losses, for logging: counted only where a backward runs, as the routers' token counts are)."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, values: Tensor, sums: Tensor) -> Tensor:
        ctx.values, ctx.sums = values, sums
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.sums.add_(torch.cat([ctx.values, ctx.values.new_ones(1)]))
        return grad, None, None


class AddLoss(torch.autograd.Function):
    """``out`` unchanged, with ``loss`` added to the gradient: its backward passes ``out``'s gradient through and gives
    ``loss`` the gradient ``scale`` (Megatron's ``MoEAuxLossAutoScaler``), so a loss made inside the model reaches the
    parameters without the model returning it (a pipeline stage's output is its activations only).

    ``scale`` is what the trainer multiplies the model's loss by before its backward (``1 / k`` under Lightning's
    gradient accumulation over ``k`` batches; 1 where gradients are scaled after the backward, as a pipeline's are).
    """

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forward networks, weights stacked per expert on dim 0, run on the tokens routed
    to each: one grouped matrix multiply per projection (torch's grouped_mm, read through ``_compat.grouped_mm``), or
    a loop over the experts (the reference, and where the device or dtype has no grouped kernel).

    Args:
        num_experts: E.
        d_model: C.
        hidden: F, one expert's hidden size.
        compute: ``auto``, ``grouped_mm`` or ``loop`` (``MoEConfig.expert_compute``).
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, compute: str = "auto") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.compute = compute
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # (E, F, C), as nn.Linear's (out, in)
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # (E, F, C)
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # (E, C, F)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Each token's weighted sum of its experts' outputs.

        Args:
            hidden_states: Tokens, shape (N, C).
            top_k_index: The experts of each token, shape (N, K), ids in ``[0, num_experts)`` of this module's
                experts.
            top_k_weights: Their weights, shape (N, K).

        Returns:
            Shape (N, C): ``sum_k top_k_weights[n, k] * expert[top_k_index[n, k]](hidden_states[n])``.
        """
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (R,)
        order = torch.argsort(flat, stable=True)  # (R,): the routed rows grouped by expert, tokens in order
        token = order // top_k  # (R,): the token of each routed row
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,): rows per expert, no read back to the host
        out = self.run_experts(hidden_states[token], counts)  # (R, C)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)  # (R, 1)
        out = (out.float() * weights.float()).to(hidden_states.dtype)  # (R, C)
        return torch.zeros_like(hidden_states).index_add_(0, token, out)  # (N, C)

    def run_experts(self, x: Tensor, counts: Tensor) -> Tensor:
        """Expert ``e``'s SwiGLU on its ``counts[e]`` consecutive rows of ``x`` (R, C) -> (R, C)."""
        gate, up, down = (w.to(x.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if self.uses_grouped_mm(x):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,): where each expert's rows end
            h = F.silu(_compat.grouped_mm(x, gate.transpose(-2, -1), offsets))  # (R, F)
            h = h * _compat.grouped_mm(x, up.transpose(-2, -1), offsets)  # (R, F)
            return _compat.grouped_mm(h, down.transpose(-2, -1), offsets)  # (R, C)
        chunks = x.split(counts.tolist())  # the loop needs the sizes on the host
        outs = [F.linear(F.silu(F.linear(c, g)) * F.linear(c, u), d) for c, g, u, d in zip(chunks, gate, up, down)]
        return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])  # (R, C)

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether :meth:`run_experts` takes the grouped matrix multiply for input ``x``.

        Raises:
            ValueError: ``compute="grouped_mm"`` where the device or dtype has no grouped kernel (one line).
        """
        if self.compute == "loop":
            return False
        supported = grouped_mm_supported(x.device, x.dtype, (x.shape[-1], self.gate_proj.shape[1]))
        if self.compute == "grouped_mm" and not supported:
            raise ValueError(
                f"model.moe.expert_compute=grouped_mm but torch's grouped_mm does not take {x.dtype} on {x.device} "
                f"with rows of {x.shape[-1]} / {self.gate_proj.shape[1]} values (CUDA bf16 on SM 8.0+, CPU fp32 / "
                "bf16 with 16-byte aligned rows); set model.moe.expert_compute=auto or loop."
            )
        return supported


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...]) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs on ``device`` in ``dtype`` with rows of ``widths`` values
    (torch 2.13: CUDA bf16 on SM 8.0+; CPU fp32 and bf16; every row 16-byte aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if any(width * size % 16 for width in widths):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward sub-layer: routed experts plus the optional shared ones.

    Args:
        cfg: Model configuration (``cfg.moe`` enabled).
        shared: The shared experts (a SwiGLU MLP every token takes), or ``None``.
    """

    def __init__(self, cfg: GPTConfig, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(cfg.d_model, cfg.moe)
        self.experts = GroupedExperts(cfg.moe.num_experts, cfg.d_model, cfg.expert_hidden, cfg.moe.expert_compute)
        self.shared = shared
        #: The factor the trainer applies to the loss before its backward (see :class:`AddLoss`); set by the module.
        self.loss_scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        top_k_index, top_k_weights, losses = self.router(tokens, B)  # (N, K) each
        out = self.experts(tokens, top_k_index, top_k_weights)  # (N, C)
        if self.shared is not None:
            out = out + self.shared(tokens)  # (N, C)
        if losses is not None:  # the balance and z losses join the gradient here
            out = AddLoss.apply(out, losses, self.loss_scale)
        return out.view(B, T, C)


# ----------------------------------------------------------------------------------------------- balancing
def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The MoE blocks ``model`` holds (a pipeline stage: its own), by module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}


def expert_load(model: nn.Module) -> Iterator[Tensor]:
    """The routers' token counts of the step so far (each (E,), in place): what a strategy sums over the data-parallel
    ranks before :func:`update_expert_bias` reads them."""
    for layer in moe_layers(model).values():
        yield layer.router.tokens_per_expert
        yield layer.router.loss_sums


@torch.no_grad()
def update_expert_bias(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Step every router's balancing bias from its counts (the global batch's, once summed), then reset the counts
    and the loss sums.

    Returns:
        Each MoE block's share of the routed tokens per expert, (E,) fractions, and the step's mean balance and z
        losses of the blocks that have them (``aux_loss/<block>``, ``z_loss/<block>``), on the device: read them only
        when logging.
    """
    shares: dict[str, Tensor] = {}
    losses: dict[str, Tensor] = {}
    for name, layer in moe_layers(model).items():
        load = layer.router.tokens_per_expert
        layer.router.update_bias(load)
        shares[name] = load / load.sum().clamp(min=1)  # a new tensor: kept when the counts are zeroed
        load.zero_()  # in place: a pipeline stage's copy of the router shares the tensor
        router, sums = layer.router, layer.router.loss_sums
        means = sums[:2] / sums[2].clamp(min=1)  # the step's mean balance and z losses of the block
        for i, (key, coef) in enumerate((("aux_loss", router.aux_loss_coef), ("z_loss", router.z_loss_coef))):
            if coef > 0:
                losses[f"{key}/{name}"] = means[i]
        sums.zero_()
    return shares, losses


def load_stats(shares: dict[str, Tensor], losses: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Metrics of the routing (device tensors): per block, the busiest expert's load over the mean (1 = balanced,
    E = every token on one expert), and its mean and maximum over the blocks; per block, the step's balance and z
    losses (coefficients applied) where they are on."""
    imbalance = {name: share.max() * share.numel() for name, share in shares.items()}
    if not imbalance:
        return {}
    values = torch.stack(list(imbalance.values()))
    stats = {f"moe/imbalance/{name}": value for name, value in imbalance.items()}
    stats.update({f"moe/{key}": value for key, value in (losses or {}).items()})
    return {"moe/imbalance": values.mean(), "moe/imbalance_max": values.max(), **stats}
