"""The 128K-token context-parallel recipes can start: ranks of their real world size, traced on torch's fake
process-group backend through the strategy's own parallelize path, hold exactly their 1 / (dp_shard x cp) share of
Llama 3.1 8B, one stepped on fake tensors at the full 131072 tokens issues exactly the collectives the planner counts,
and the planner's per-rank memory is the number each recipe states and fits an 80 GB H100."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config

from lightning_dist.models.gpt import GPT
from lightning_dist.plan.memory import GIB, count_local_params
from lightning_dist.run.launch import launch

H100_GIB = 79.6  # 81559 MiB as nvidia-smi reports it
#: recipe -> the planner's per-rank peak its header states (GiB)
RECIPES = {"llama_8b_128k_cp_8gpu": 38.5, "llama_8b_128k_cp_64gpu": 53.8}  # with loss_chunks=8


def _trace(overrides: list[str], rank: int, step: bool):
    from lightning_dist.plan.trace import trace_rank

    return trace_rank(compose_config(overrides), rank, step=step)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cp_recipe_ranks_hold_their_share_and_fit_an_h100(recipe: str) -> None:
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.cost import estimate
    from lightning_dist.plan.estimate_run import layout_of

    cfg = compose_config([f"recipe={recipe}"])
    dims = build_parallel_dims(cfg)
    assert dims.cp == 8 and cfg.data.seq_len == 131072
    expected = count_local_params(cfg.model, tp=dims.tp, dp_shard=dims.dp_shard * dims.cp)  # FSDP2 over dp_shard x cp
    with torch.device("meta"):
        whole = GPT(cfg.model).num_params(exclude_embedding=False)
    assert expected * dims.tp * dims.dp_shard * dims.cp == pytest.approx(whole, rel=1e-3)
    for rank in (0, dims.world_size - 1):
        trace = launch(_trace, 1, [f"recipe={recipe}"], rank, False)[0]
        assert trace.local_params == expected, (rank, trace.local_params, expected)
        assert trace.param_bytes == 4 * expected  # fp32 master weights
    found = estimate(cfg.model, layout_of(cfg, dims), cfg.hardware, cfg.data.seq_len, cfg.data.global_batch_size)
    assert round(found.memory.total / GIB, 1) == RECIPES[recipe]  # the number the recipe states
    assert found.memory.fits(H100_GIB), found.memory.gib()


def test_a_full_size_cp_rank_issues_the_planned_collectives() -> None:
    """Rank 0 of the 8-GPU recipe (one 131072-token sequence per step) stepped once on fake tensors: its cp
    all-gathers of keys and values (forward and full recomputation) and reduce-scatters of their gradients, and
    FSDP2's traffic over dp_shard x cp, are the planner's, byte for byte and call for call."""
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.collectives import per_axis, step_collectives
    from lightning_dist.plan.estimate_run import layout_of

    overrides = ["recipe=llama_8b_128k_cp_8gpu", "data.global_batch_size=1"]  # one micro batch: a shorter trace
    cfg = compose_config(overrides)
    traced = launch(_trace, 1, overrides, 0, True)[0]
    layout = layout_of(cfg, build_parallel_dims(cfg))
    collectives = step_collectives(cfg.model, layout, cfg.data.seq_len, cfg.cluster.precision, stage=0, loop=False)
    # cp=8 spans the world: torch gives the cp axis and FSDP2's dp_shard_cp (here the cp ranks) one group object,
    # reported as cp by the tracker and the planner alike (tests/distributed/test_cp_planner.py).
    assert traced.collectives == per_axis(collectives) == {"cp": per_axis(collectives)["cp"]}
    kv = 2 * 8 * 128 * 131072 * 2  # keys and values of the whole sequence: 8 heads of 128, bf16
    attention = per_axis([c for c in collectives if c.what.startswith("CP: ")])
    assert attention["cp"] == {"bytes": kv * (32 + 32 + 32), "calls": 96}  # forward, recomputation, backward
