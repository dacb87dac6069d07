"""The expert-parallel recipes (Mixtral-8x7B and a DeepSeek-V2-Lite-class GPT on 8 and 64 GPUs) can start: ranks of
their real world size, built at full size on the meta device and laid out on torch's fake process-group backend
through the strategy's own parallelize path (expert parallelism, FSDP2 of the dense parts and of the experts, TP and
the pipeline split of the 64-GPU Mixtral), hold exactly the parameters the planner counts, and the gradients and
AdamW state built on fake tensors from their shards are the planner's bytes; the planner's per-rank peak is the
number each recipe states and fits an 80 GB H100.

Rank 0 of the 8-GPU DeepSeek recipe also steps once on fake tensors at full size (one micro batch of 4096 tokens):
its all-to-alls on ep and FSDP2's traffic (dense units over dp_shard, the experts' over efsdp) are the planner's, byte
for byte and call for call. The dropless dispatch reads its split sizes back to the host, which fake tensors cannot
give: the trace supplies a balanced routing's (``plan/trace.py``), which is what the planner counts (the ep
all-to-all bytes of real, unbalanced CPU runs are checked against it in test_expert_parallel.py)."""

from __future__ import annotations

import pytest
from helpers import compose_config

from lightning_dist.run.launch import launch

H100_GIB = 79.6  # 81559 MiB as nvidia-smi reports it
#: recipe -> (the planner's per-rank peak its header states in GiB, its tokens/s per GPU)
RECIPES = {
    "mixtral_8x7b_ep_8gpu": (68.3, 2843),
    "mixtral_8x7b_ep_64gpu": (64.5, 5822),
    "deepseek_v2_lite_ep_8gpu": (66.5, 26362),
    "deepseek_v2_lite_ep_64gpu": (66.5, 26362),
}


def _ranks(recipe: str) -> tuple[int, ...]:
    """Rank 0, and the last rank where a pipeline puts other blocks there."""
    from lightning_dist.config.validate import build_parallel_dims

    dims = build_parallel_dims(compose_config([f"recipe={recipe}"]))
    return (0, dims.world_size - 1) if dims.pp > 1 else (0,)


#: The stepped rank: rank 0 of the 8-GPU DeepSeek recipe, one micro batch per step.
STEPPED = ["recipe=deepseek_v2_lite_ep_8gpu", "data.global_batch_size=8"]


def _trace_all(recipes: list[str]) -> tuple[dict[tuple[str, int], tuple[int, int, int, int]], dict, float]:
    """Every recipe's ranks traced one after the other in this one process, then the stepped one, then what the ep
    dispatch keeps."""
    from lightning_dist.plan.trace import trace_rank

    found = {}
    for recipe in recipes:
        cfg = compose_config([f"recipe={recipe}"])
        for rank in _ranks(recipe):
            trace = trace_rank(cfg, rank, states=True)
            found[recipe, rank] = (trace.local_params, trace.param_bytes, trace.grad_bytes, trace.optimizer_bytes)
    return found, trace_rank(compose_config(STEPPED), 0, step=True).collectives, _dispatch_extra_per_row()


def _dispatch_extra_per_row(d_model: int = 128) -> float:
    """bf16 elements per routed row that the ep dispatch keeps for the backward beyond the experts' own forward, in
    units of ``d_model``: the real :class:`ExpertDispatch` over a one-rank gloo group (its all-to-alls are copies)."""
    import torch
    import torch.distributed as dist

    from lightning_dist.models.moe import GroupedExperts
    from lightning_dist.parallel.expert import ExpertDispatch
    from lightning_dist.parallel_dims import ParallelDims

    experts_, top_k, tokens = 8, 2, 256
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        experts = GroupedExperts(experts_, d_model, 256, "grouped_mm").to(torch.bfloat16)
        dispatch = ExpertDispatch(experts, ParallelDims(1, dp_shard=1), experts_)
        dispatch.ep_group = dist.group.WORLD  # one rank: the dispatch's all-to-alls run as copies

        def saved(forward) -> float:
            x = torch.randn(tokens, d_model, dtype=torch.bfloat16, requires_grad=True)
            index = torch.stack([torch.randperm(experts_)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k, requires_grad=True)
            skip = {t.untyped_storage().data_ptr() for t in (x, weights, *experts.parameters())}
            storages: dict[int, int] = {}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.untyped_storage().data_ptr() not in skip:
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(x, index, weights)
            out.float().sum().backward()
            return sum(storages.values()) / 2 / (tokens * top_k)

        return (saved(dispatch._dispatch_and_combine) - saved(experts.forward)) / d_model
    finally:
        dist.destroy_process_group()


#: The recipe traced on every test run (its rank is also stepped); the others are traced by ``make test-all``.
FAST = "deepseek_v2_lite_ep_8gpu"


@pytest.fixture(scope="module")
def traced(request: pytest.FixtureRequest) -> tuple[dict[tuple[str, int], tuple[int, int, int, int]], dict, float]:
    """The recipes whose tests this session runs, traced in one process (a full-size trace takes 5-15 s)."""
    selected = [
        recipe for recipe in RECIPES
        if any(item.path == request.path and recipe in item.name for item in request.session.items)
    ]  # fmt: skip
    return launch(_trace_all, 1, selected or [FAST])[0]


@pytest.mark.parametrize("recipe", [r if r == FAST else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_moe_recipe_ranks_hold_the_planned_states_and_fit_an_h100(recipe: str, traced) -> None:
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.cost import estimate
    from lightning_dist.plan.estimate_run import layout_of
    from lightning_dist.plan.experts import rank_local_params
    from lightning_dist.plan.memory import GIB

    cfg = compose_config([f"recipe={recipe}"])
    dims = build_parallel_dims(cfg)
    assert dims.ep > 1 and cfg.model.moe.enabled
    layout = layout_of(cfg, dims)
    planned = rank_local_params(cfg.model, layout)  # per pipeline rank
    found = estimate(cfg.model, layout, cfg.hardware, cfg.data.seq_len, cfg.data.global_batch_size)
    for rank in _ranks(recipe):
        local, param_bytes, grad_bytes, optimizer_bytes = traced[0][recipe, rank]
        expected = planned[dims.coordinates(rank)["pp"]]
        assert local == expected, (rank, local, expected)
        assert param_bytes == 4 * expected  # fp32 master weights
        assert grad_bytes == 4 * expected  # fp32 gradients of every parameter
        assert optimizer_bytes == pytest.approx(8 * expected, rel=1e-4)  # AdamW's two moments (+ its step counts)
    assert found.memory.params == 4 * max(planned) and found.memory.grads == 4 * max(planned)
    stated_gib, stated_tokens = RECIPES[recipe]
    assert round(found.memory.total / GIB, 1) == stated_gib  # the numbers the recipe states
    assert round(found.tokens_per_sec_per_device) == stated_tokens
    assert found.memory.fits(H100_GIB), found.memory.gib()
    if cfg.parallelism.fsdp.cpu_offload:  # the states are on the host: on the device they would not fit
        assert found.memory.offloaded
        states = found.memory.params + found.memory.grads + found.memory.optimizer
        assert (found.memory.total / (1 + found.memory.margin) + states) / GIB > H100_GIB


def test_a_full_size_ep_rank_issues_the_planned_collectives(traced) -> None:
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.collectives import per_axis, step_collectives
    from lightning_dist.plan.estimate_run import layout_of
    from lightning_dist.plan.experts import expert_collectives

    cfg = compose_config(STEPPED)
    layout = layout_of(cfg, build_parallel_dims(cfg))
    seq, precision = cfg.data.seq_len, cfg.cluster.precision
    planned = step_collectives(cfg.model, layout, seq, precision, stage=0, loop=False)
    planned += expert_collectives(cfg.model, layout, seq, precision, stage=0)
    assert traced[1] == per_axis(planned)
    rows = 4096 * 6 * 2048 * 2  # a micro batch's routed rows: 4096 tokens x top-6, bf16 rows of d_model
    assert per_axis(planned)["ep"]["bytes"] == 26 * (4 * rows + 64 * 8)  # 26 MoE blocks: rows there and back, twice


def test_the_ep_dispatch_keeps_what_the_planner_counts(traced) -> None:
    """Beyond the experts' own forward, the dispatch keeps ``DISPATCH_ROW_EXTRA x d_model`` elements per routed row
    (the planner's MoE activations under ep > 1; the rest of the block is tests/unit/test_plan_moe.py's)."""
    from lightning_dist.plan.moe_memory import DISPATCH_ROW_EXTRA

    assert traced[2] == pytest.approx(DISPATCH_ROW_EXTRA, abs=0.1)
