"""The planner's view of a GPT with mixture-of-experts blocks (:mod:`lightning_dist.models.moe`): their parameters,
where a rank's shards of them live, and what their forward keeps for the backward.

**Parameters.** A block from ``moe.dense_layers`` on holds attention and norms as a dense block, then in place of the
MLP a router gate ``(E, C)``, ``E`` routed SwiGLU experts (``3 C F`` each, ``F`` = ``expert_hidden``) and the shared
experts (one SwiGLU of ``shared_experts x F``). On a rank (:mod:`lightning_dist.parallel.expert`,
:mod:`lightning_dist.parallel_dims`):

- the *dense* parameters (attention, norms, router, shared experts, embedding, head, the dense blocks) are laid out
  as in a dense GPT: tensor-parallel over ``tp`` (the router and the norms whole on every tp rank) and FSDP2-sharded
  over ``dp_shard x cp``;
- the *routed experts* are split over ``ep`` (``E / ep`` consecutive experts per rank), whole on every ``tp`` rank,
  and FSDP2-sharded over the ranks holding the same experts, ``efsdp x cp`` (``efsdp = dp_shard / ep``); FSDP2 pads
  dim 0 (the local experts) to a multiple of that, so a rank holds ``ceil((E / ep) / (efsdp cp))`` experts' rows at
  most (the count here: the largest rank's); with fewer local experts than those ranks each expert is sharded along
  its rows instead (``parallel/expert.py``: dim 1, ``F`` rows of gate / up, ``C`` of down, each padded).

Gradients and AdamW moments follow the parameters (fp32 each, as :mod:`lightning_dist.plan.memory` counts them).

**Activations** (bf16 elements per token of the block's input; measured with saved-tensor hooks on a bf16 MoE block,
grouped_mm and loop alike, ``C`` 256, ``F`` 512 / 1024, ``E`` 8 / 16, ``K`` 2 / 4, 0 / 2 shared experts, and exact to
0.3% against them): the MoE sub-layer keeps, in place of the dense MLP's ``4 f``,

- the router's fp32 softmax (or sigmoid) scores, ``2 E`` (whole on every tp rank: the router sees every token);
- per routed row (``K`` per token, split over ``tp``: each tp rank runs the experts on its ``1 / tp`` of the tokens)
  ``4 F + 4 C + 16``: the grouped matmuls' input rows, the gate and up outputs, SwiGLU's activation and product (as the
  dense MLP's four), the fp32 copy of the expert output that the router weight multiplies, and the row's int64 ids;
- the shared experts as a dense MLP of ``shared_experts x F``, ``4 S F / tp``.

Under ``ep > 1`` the dispatch (:class:`~lightning_dist.parallel.expert.ExpertDispatch`) runs the experts' own forward
on the received rows (``K`` per token on average: a balanced ep group receives what it sends) and weighs the rows
that come back: ``C`` more per routed row (its all-to-alls keep nothing), measured with saved-tensor hooks on the
real dispatch over a one-rank group (``tests/distributed/test_moe_recipes.py``).
"""

from __future__ import annotations

import math

from lightning_dist.models.gpt import GPTConfig

#: bf16 elements kept per routed row beyond its ``4 F``: input row, fp32 weighted output (2), ids (module docstring).
ROUTED_ROW_EXTRA = 4
ROUTED_ROW_IDS = 16  # the row's int64 ids (sort order, token, expert: 4 elements each) and its fp32 weight
#: More per routed row under ep > 1, times ``C``: the dispatch's own copy of the rows (module docstring).
DISPATCH_ROW_EXTRA = 1


def expert_params(cfg: GPTConfig) -> int:
    """Parameters of one MoE block's routed experts (``E x 3 C F``); 0 for a dense GPT."""
    return cfg.moe.num_experts * 3 * cfg.d_model * cfg.expert_hidden if cfg.moe.enabled else 0


def moe_dense_params(cfg: GPTConfig) -> int:
    """Parameters of one MoE block outside its routed experts: attention, norms, router, shared experts."""
    h, kv = cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim
    shared = 3 * h * cfg.moe.shared_experts * cfg.expert_hidden
    return h * (h + kv) + h * h + 2 * h + cfg.moe.num_experts * h + shared


def moe_layers(cfg: GPTConfig, layers: range | list[int] | None = None) -> int:
    """MoE blocks among ``layers`` (block indices; all of the model's by default)."""
    indices = range(cfg.n_layers) if layers is None else layers
    return sum(cfg.is_moe_layer(i) for i in indices)


def expert_shard(cfg: GPTConfig, ep: int, dp_shard: int, cp: int) -> int:
    """Routed-expert parameters of one MoE block on the rank holding the most: ``E / ep`` experts, FSDP2-sharded
    over ``efsdp x cp`` with dim 0 padded (module docstring)."""
    if not cfg.moe.enabled:
        return 0
    local = cfg.moe.num_experts // ep
    shard = dp_shard // ep * cp
    if local >= shard or ep == 1:  # ep = 1: the experts are in their block's FSDP2 unit, sharded on dim 0
        return math.ceil(local / shard) * expert_params(cfg) // cfg.moe.num_experts
    # ep > 1, fewer local experts than ranks: sharded along their rows (gate / up: F of them, down: C), each padded
    hidden, width = cfg.expert_hidden, cfg.d_model
    return local * (2 * math.ceil(hidden / shard) * width + math.ceil(width / shard) * hidden)


def active_block_params(cfg: GPTConfig, index: int, dense_block: int) -> int:
    """Parameters one token passes through in block ``index``: ``dense_block`` (a dense block's count) or, in an MoE
    block, all but the ``E - K`` routed experts it does not take (the FLOPs' ``N``, as ``GPT.num_active_params``)."""
    if not cfg.is_moe_layer(index):
        return dense_block
    return moe_dense_params(cfg) + expert_params(cfg) * cfg.moe.top_k // cfg.moe.num_experts


def moe_activation_elements(cfg: GPTConfig, tp: int, ep: int) -> float:
    """The MoE sub-layer's activation elements per token (no checkpointing), in place of the dense MLP's ``4 f / tp``
    (module docstring)."""
    moe, width = cfg.moe, cfg.expert_hidden
    per_row = 4 * width + (ROUTED_ROW_EXTRA + (DISPATCH_ROW_EXTRA if ep > 1 else 0)) * cfg.d_model + ROUTED_ROW_IDS
    return 2 * moe.num_experts + moe.top_k * per_row / tp + 4 * moe.shared_experts * width / tp


def moe_selective_elements(cfg: GPTConfig, tp: int, half: bool = False) -> float:
    """The MoE sub-layer's elements per token under selective (op) checkpointing: the matmul outputs kept (router
    logits in fp32; per routed row the gate, up and down outputs, ``2 F + C``; the shared experts' as the MLP's),
    ``op_half`` every other matmul's."""
    moe, width = cfg.moe, cfg.expert_hidden
    routed = moe.top_k * (2 * width + cfg.d_model) / tp
    shared = moe.shared_experts * 2 * width / tp
    return 2 * moe.num_experts + (routed + shared) / (2 if half else 1)
