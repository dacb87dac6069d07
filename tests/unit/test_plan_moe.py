"""The planner on MoE GPTs: parameters against the model built on meta, a rank's shards of dense parameters and
experts, the MoE block's activations against saved-tensor hooks on a real block, the ep all-to-all's time on its link,
the search over ep, and cpu_offload."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import compose_config

from lightning_dist.config.schema import HardwareConfig
from lightning_dist.models.gpt import GPT, Block, GPTConfig
from lightning_dist.models.gpt_config import MoEConfig
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.cost import estimate, flops_per_token_of, offload_seconds, stage_params
from lightning_dist.plan.experts import expert_collectives, local_params, rank_local_params
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.memory import block_activation_elements, count_local_params
from lightning_dist.plan.search import layouts, rank

# 8 experts of hidden 48, top-2, one shared expert, the first block dense: d_model 64, 4 heads (2 key / value heads).
MOE = MoEConfig(num_experts=8, top_k=2, hidden=48, shared_experts=1, dense_layers=1)
TINY = GPTConfig(vocab_size=256, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, moe=MOE)
ATTENTION = 64 * 64 * 2 + 64 * 32 * 2  # q, o; k, v of 2 heads of 16
EXPERTS = 8 * 3 * 64 * 48  # one MoE block's routed experts
MOE_DENSE = ATTENTION + 2 * 64 + 8 * 64 + 3 * 64 * 48  # attention, norms, router, shared expert
HW = HardwareConfig(peak_tflops=100.0, compute_efficiency=0.5, intra_node_gbps=100.0, inter_node_gbps=10.0)


def test_moe_parameters_and_flops_equal_the_model_built_on_meta() -> None:
    with torch.device("meta"):
        model = GPT(TINY)
    dense = ATTENTION + 2 * 64 + 3 * 64 * TINY.hidden_dim
    assert stage_params(TINY, 1) == dense + 2 * (MOE_DENSE + EXPERTS) + 2 * 256 * 64 + 64
    assert stage_params(TINY, 1) == model.num_params(exclude_embedding=False)
    assert flops_per_token_of(TINY, 128) == model.flops_per_token(128)  # the top_k experts a token takes


def test_a_rank_holds_its_dense_share_and_one_ep_th_of_the_experts() -> None:
    whole = stage_params(TINY, 1)
    norms = (2 * 3 + 1) * 64
    routers = 2 * 8 * 64
    sharded = whole - 2 * EXPERTS - norms - routers
    # fsdp4: every tensor over 4 ranks, experts too (2 of the 8 per rank)
    assert count_local_params(TINY, dp_shard=4) == (whole - 2 * EXPERTS) // 4 + 2 * EXPERTS // 4
    # fsdp4 x ep2: 4 experts per rank, each FSDP2-sharded over the other 2 ranks: still 2 experts' worth
    assert count_local_params(TINY, dp_shard=4, ep=2) == count_local_params(TINY, dp_shard=4)
    # fsdp4 x ep4 x tp2: 2 experts per rank, whole on both tp ranks; norms and routers whole on tp, sharded on dp
    assert count_local_params(TINY, tp=2, dp_shard=4, ep=4) == sharded // 8 + (norms + routers) // 4 + 2 * EXPERTS // 4
    # ep8 on dp_shard 8: one expert per rank, whole (efsdp = 1)
    lay = Layout.of(1, 1, dp_shard=8, ep=8)
    assert (
        local_params(TINY, lay)
        == count_local_params(TINY, dp_shard=8, ep=8)
        == (whole - 2 * EXPERTS) // 8 + (2 * EXPERTS // 8)
    )
    # FSDP2 pads dim 0: ep1 over 16 ranks leaves half of them without experts, the first holds a whole one
    assert count_local_params(TINY, dp_shard=16) == (whole - 2 * EXPERTS - routers) // 16 + 2 * (64 + EXPERTS // 8)
    # ep2 over 16 ranks: 4 experts per rank, fewer than the 8 ranks sharding them, so each is sharded along its rows
    # (parallel/expert.py: dim 1, F rows of gate and up, C of down): every rank a 1/8 of its 4 experts
    f, c = TINY.expert_hidden, TINY.d_model
    rows = 4 * (2 * -(-f // 8) * c + -(-c // 8) * f)
    assert count_local_params(TINY, dp_shard=16, ep=2) == (whole - 2 * EXPERTS - routers) // 16 + 2 * (64 + rows)
    # pipeline: the dense block and the embedding on stage 0, an MoE block and the head on stage 1
    per_rank = rank_local_params(TINY, Layout.of(1, 2, pp=2, dp_shard=2, ep=2))
    assert sum(per_rank) * 2 == whole  # each stage in 2 shards (the experts: 4 of 8 on each ep rank, whole)
    assert local_params(TINY, Layout.of(1, 2, pp=2, dp_shard=2, ep=2)) == max(per_rank)


def _saved_elements_per_token(cfg: GPTConfig, tokens: int = 256) -> float:
    """bf16 elements a block's forward keeps for its backward per token (no RoPE), parameters and input left out."""
    torch.manual_seed(0)
    block = Block(cfg, 1).to(torch.bfloat16)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    x = torch.randn(2, tokens // 2, cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    return sum(storages.values()) / tokens / 2


@pytest.mark.parametrize(("experts", "top_k", "hidden", "shared"), [(8, 2, 256, 0), (16, 4, 128, 2)])
def test_the_moe_block_keeps_what_the_planner_counts(experts: int, top_k: int, hidden: int, shared: int) -> None:
    """The MoE sub-layer's saved activations over the dense MLP's, measured on a bf16 block (grouped matmuls)."""
    moe = MoEConfig(num_experts=experts, top_k=top_k, hidden=hidden, shared_experts=shared, balance_rate=0.0)
    cfg = GPTConfig(d_model=128, n_heads=4, n_layers=2, ffn_hidden=hidden, moe=moe)
    dense = replace(cfg, moe=MoEConfig())
    measured = _saved_elements_per_token(cfg) - _saved_elements_per_token(dense)
    planned = block_activation_elements(cfg, 1, "none", moe=True) - block_activation_elements(dense, 1, "none")
    assert planned == pytest.approx(measured, rel=0.01), (planned, measured)


def test_the_ep_all_to_all_runs_on_the_link_its_group_spans() -> None:
    seq, batch = 32, 16
    inside = estimate(TINY, Layout.of(2, 1, dp_shard=16, ep=4), HW, seq, 2 * batch)  # 2 nodes of 8
    sent = sum(c.bytes for c in expert_collectives(TINY, inside.layout, seq))
    assert inside.comm["ep"]["bytes"] == sent > 0
    assert inside.comm["ep"]["seconds"] == pytest.approx(sent * 3 / 4 / 100e9)  # 4 neighbouring ranks: NVLink
    assert inside.comm["ep"]["exposed_s"] == inside.comm["ep"]["seconds"]  # never hidden
    two_nodes = HardwareConfig(**{**HW.__dict__, "gpus_per_node": 4})
    across = estimate(TINY, Layout.of(2, 1, dp_shard=8, ep=8), two_nodes, seq, batch)  # 8 ranks over 2 nodes
    sent = sum(c.bytes for c in expert_collectives(TINY, across.layout, seq))  # + the experts' gradient norm
    norm = across.comm["ep"]["bytes"] - sent  # all-reduced on ep: no other rank holds the same experts
    assert across.comm["ep"]["seconds"] == pytest.approx((sent * 7 / 8 + norm * 2 * 7 / 8) / 10e9)


def test_the_search_tries_every_ep_dividing_the_experts_and_dp_shard() -> None:
    cfg = compose_config(["model=moe_tiny"])
    found = {(lay.dp_shard, lay.ep) for lay in layouts(cfg.model, 8, 16, 8, cfg.plan)}
    assert {ep for shard, ep in found if shard == 8} == {1, 2, 4, 8}
    assert {ep for shard, ep in found if shard == 4} == {1, 2, 4}
    assert {lay.ep for lay in layouts(GPTConfig(), 8, 16, 8, cfg.plan)} == {1}  # a dense GPT: no ep
    assert all(lay.sync == "every_step" for lay in layouts(cfg.model, 8, 16, 4, cfg.plan) if lay.ep > 1)


def test_a_small_batch_of_a_many_expert_model_plans_expert_parallelism() -> None:
    """DeepSeek-V2-Lite's shape on 64 H100s with 64 x 1024 tokens per step: FSDP2 would gather every expert of a
    block for a few tokens; the best layout splits the experts instead."""
    cfg = compose_config(["model=deepseek_v2_lite", "hardware=h100_sxm", "plan.micro_batches=[1,2,4]"])
    best = rank(cfg.model, cfg.hardware, 64, 1024, 64, cfg.plan)[0]
    assert best.fits and best.layout.ep > 1, best.layout.describe()


def test_cpu_offload_keeps_the_states_on_the_host_and_costs_their_copies() -> None:
    seq, batch = 32, 16
    on = estimate(TINY, Layout.of(2, 1, dp_shard=8, cpu_offload=True), HW, seq, batch)
    off = estimate(TINY, Layout.of(2, 1, dp_shard=8), HW, seq, batch)
    states = off.memory.params + off.memory.grads + off.memory.optimizer
    assert (on.memory.params, on.memory.grads, on.memory.optimizer) == (off.memory.params, off.memory.grads,
                                                                        off.memory.optimizer)  # fmt: skip
    assert on.memory.offloaded and not off.memory.offloaded
    unit = (MOE_DENSE + EXPERTS) * 4 / 8  # the largest unit's fp32 shard, copied to the device for its all-gather
    assert on.memory.buffers - off.memory.buffers == int(unit)
    device = on.memory.activations + on.memory.logits + on.memory.buffers
    assert on.memory.total == int(device * 1.1) and off.memory.total == int((device - int(unit) + states) * 1.1)
    local = off.memory.params // 4
    assert on.step_s == pytest.approx(off.step_s + offload_seconds(on.layout, local, 3))
    assert offload_seconds(on.layout, local, 3) == pytest.approx(local * 4 * (2 * 3 / 4 + 1) / 25e9 + local * 28 / 20e9)
    with pytest.raises(ValueError, match="cpu_offload"):
        Layout.of(2, 1, tp=2, cpu_offload=True)
    assert ParallelDims(8, dp_shard=8, ep=2).dp_cp_enabled
