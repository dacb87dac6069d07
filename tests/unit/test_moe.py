"""The GPT's mixture-of-experts block without a process group: the grouped experts equal a per-token reference (the
loop over experts and torch's grouped matrix multiply alike), the balancing bias picks experts without weighing them,
and each ``model.moe`` / ``parallelism.ep`` config that cannot run stops with one line before launch."""

from __future__ import annotations

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate
from lightning_dist.models.gpt import GPT, GPTConfig, MoEConfig
from lightning_dist.models.moe import GroupedExperts, Router, grouped_mm_supported, load_stats, update_expert_bias
from lightning_dist.parallel_dims import ParallelDims

MOE = MoEConfig(num_experts=4, top_k=2, hidden=16, shared_experts=1)
TINY = GPTConfig(vocab_size=32, n_layers=2, d_model=16, n_heads=2, max_seq_len=16, moe=MOE)


def _experts(compute: str) -> GroupedExperts:
    experts = GroupedExperts(4, 16, 16, compute).double()
    generator = torch.Generator().manual_seed(0)
    for param in experts.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return experts


def _per_token(experts: GroupedExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition: each token's weighted sum of its experts' SwiGLU outputs, one token at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = index[n, k]
            h = torch.nn.functional.silu(experts.gate_proj[e] @ x[n]) * (experts.up_proj[e] @ x[n])
            out[n] += weights[n, k] * (experts.down_proj[e] @ h)
    return out


def _routing(tokens: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 16, generator=generator, dtype=torch.float64)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(tokens)])
    index[:, 0] = torch.where(index[:, 0] == 3, 0, index[:, 0])  # expert 3 gets fewer tokens than the rest
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % 3, index[:, 1])
    weights = torch.rand(tokens, 2, generator=generator, dtype=torch.float64)
    return x, index, weights


def test_the_loop_over_experts_is_each_tokens_weighted_sum_of_its_experts():
    experts = _experts("loop")
    x, index, weights = _routing()
    torch.testing.assert_close(experts(x, index, weights), _per_token(experts, x, index, weights))


@pytest.mark.skipif(not grouped_mm_supported(torch.device("cpu"), torch.float32, (16,)), reason="no CPU grouped_mm")
def test_grouped_mm_equals_the_loop_forward_and_backward():
    """float32 (grouped_mm has no float64 kernel): forward and every gradient, an expert left without tokens too."""
    results = []
    for compute in ("loop", "grouped_mm"):
        experts = _experts(compute).float()
        x, index, weights = (t.float() if t.is_floating_point() else t for t in _routing())
        index[index == 2] = 1  # expert 2 gets no token: an empty group
        x.requires_grad_(True)
        out = experts(x, index, weights)
        assert experts.uses_grouped_mm(x) == (compute == "grouped_mm")
        out.pow(2).sum().backward()
        results.append([out, x.grad, *(p.grad for p in experts.parameters())])
    for loop, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_grouped_mm_refused_where_it_has_no_kernel_is_one_line():
    experts = GroupedExperts(4, 16, 16, "grouped_mm").double()
    with pytest.raises(ValueError, match=r"^model.moe.expert_compute=grouped_mm but .* set model.moe.expert_compute="):
        experts.uses_grouped_mm(torch.zeros(2, 16, dtype=torch.float64))


def test_the_balancing_bias_picks_experts_but_never_weighs_them():
    router = Router(16, MoEConfig(num_experts=4, top_k=1, balance_rate=0.1, route_norm=False)).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    index, weights, _ = router(x)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 now wins every token
    biased_index, biased_weights, _ = router(x)
    assert (biased_index == 3).all()
    scores = router.gate(x).softmax(-1)
    torch.testing.assert_close(biased_weights, scores[:, 3:].float())  # its unbiased score
    torch.testing.assert_close(weights, scores.gather(-1, index).float())


def test_update_expert_bias_moves_toward_the_mean_load_and_resets_the_counts():
    model = GPT(TINY)
    model.init_weights(0)
    router = model.layers["0"].moe.router
    router.tokens_per_expert.copy_(torch.tensor([8.0, 0.0, 4.0, 4.0]))
    shares, _ = update_expert_bias(model)
    rate = MOE.balance_rate
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1.0, 1.0, 0.0, 0.0]) * rate)
    assert router.tokens_per_expert.eq(0).all()
    assert float(load_stats(shares)["moe/imbalance/layers.0.moe"]) == 2.0  # 8 of 16 tokens on one of 4 experts


def test_active_parameters_leave_out_the_experts_a_token_skips():
    model = GPT(TINY)
    per_expert = 3 * 16 * 16
    assert model.num_params() - model.num_active_params() == 2 * (4 - 2) * per_expert


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.ep=2"], r"^parallelism.ep=2 but the GPT has no MoE blocks; set model.moe.num_experts"),
        (["model=moe_tiny", "parallelism.ep=3", "cluster.devices=3", "data.global_batch_size=12"],
         r"^parallelism.ep=3 does not divide the 8 experts of each MoE block \(model.moe.num_experts\); use an ep in "
         r"\[1, 2, 4, 8\]\.$"),
        (["model=moe_tiny", "parallelism=tp_fsdp", "parallelism.ep=2", "parallelism.tp=2", "parallelism.dp_shard=1"],
         r"^ep=2 does not divide dp_shard=1 \(world_size=2\): .* use an ep dividing dp_shard"),
        (["model=moe_tiny", "model.moe.top_k=9"], r"^model.moe.top_k=9 must be in \[1, model.moe.num_experts=8\]\.$"),
        (["model=moe_tiny", "model.arch=gpt2"], r"^model.moe.num_experts=8 with model.arch='gpt2': .* SwiGLU"),
        (["model=moe_tiny", "model.moe.score_func=relu"], r"^model.moe.score_func='relu' is unknown"),
        (["model=moe_tiny", "parallelism.compile=true"], r"^parallelism.compile=true with parallelism.ep=2"),
        (["model=moe_tiny", "model.moe.aux_loss_coef=0.01", "parallelism.ep=1", "parallelism.cp=2"],
         r"^cp=2 with model.moe.aux_loss_coef=0.01: the sequence-wise balance loss needs each sequence whole"),
        (["model=moe_tiny", "model.moe.z_loss_coef=-1"], r"^model.moe.z_loss_coef=-1.0 must be >= 0"),
    ],
)  # fmt: skip
def test_an_moe_config_that_cannot_run_is_one_line(overrides, message):
    base = [*FAST, "parallelism=ep", "cluster.devices=2"]
    with pytest.raises(ValueError, match=message):
        validate(compose_config([*base, *overrides]))


def test_parallelism_ep_composes_with_moe_tiny():
    valid = validate(compose_config([*FAST, "model=moe_tiny", "parallelism=ep", "cluster.devices=4"]))
    assert (valid.dims.ep, valid.dims.dp_shard, valid.cfg.model.moe.num_experts) == (2, 4, 8)
    assert ParallelDims(4, dp_shard=4, ep=2).coordinates(3)["dp_shard"] == 3  # dp_shard = (efsdp, ep), ep inside
    assert [ParallelDims(4, dp_shard=4, ep=2).ep_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_pp_with_ep_knows_whether_torch_infers_stage_shapes_on_real_tensors(monkeypatch):
    """torch 2.13 runs a stage on empty real tensors to infer its shapes (the all-to-all can run); 2.11 on meta tensors,
    where the strategy refuses pp x ep in one line (parallel/pipeline_stages.py)."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_dist import _compat

    assert _compat.infers_stage_shapes_on_real_tensors() == hasattr(PipelineStage, "_forward_metadata_inference")
    monkeypatch.delattr(PipelineStage, "_forward_metadata_inference", raising=False)
    assert not _compat.infers_stage_shapes_on_real_tensors()
