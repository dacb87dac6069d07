"""The 8B and 70B recipes can start: ranks of their real world size, traced on torch's fake process-group backend
through the strategy's own parallelize path, hold exactly their share of the model, and the per-rank estimate of
parameters + gradients + optimizer + activations + buffers fits an 80 GB H100.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config

from lightning_dist.models.gpt import GPT
from lightning_dist.plan.memory import count_local_params, estimate_memory
from lightning_dist.run.launch import launch

H100_GIB = 79.6  # 81559 MiB as nvidia-smi reports it
RECIPES = ["llama_8b_tp_fsdp_8gpu", "llama_70b_tp_fsdp_64gpu"]


def _trace(recipe: str, rank: int):
    from lightning_dist.plan.trace import trace_rank

    return trace_rank(compose_config([f"recipe={recipe}"]), rank)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_ranks_hold_their_share_and_fit_an_h100(recipe: str) -> None:
    from lightning_dist.config.validate import build_parallel_dims, options_of
    from lightning_dist.parallel.options import ParallelOptions

    cfg = compose_config([f"recipe={recipe}"])
    dims, options = build_parallel_dims(cfg), options_of(cfg)
    data = cfg.data
    expected = count_local_params(cfg.model, tp=dims.tp, dp_shard=dims.dp_shard)
    with torch.device("meta"):
        whole = GPT(cfg.model).num_params(exclude_embedding=False)
    assert expected * dims.tp * dims.dp_shard == pytest.approx(whole, rel=1e-3)  # a 1/(tp x dp_shard) share
    for rank in (0, dims.world_size - 1):
        trace = launch(_trace, 1, recipe, rank)[0]
        assert trace.local_params == expected, (rank, trace.local_params, expected)
        assert trace.param_bytes == 4 * expected  # fp32 master weights; bf16 only in FSDP2's gathered copies
        estimate = estimate_memory(
            cfg.model,
            dims,
            options,
            local_params=trace.local_params,
            seq_len=data.seq_len,
            micro_batch=data.micro_batch_size,
        )
        assert estimate.fits(H100_GIB), estimate.gib()
    # What the recipe settings buy: the whole per-rank batch in one forward, nothing recomputed, would not fit.
    per_rank = data.global_batch_size // dims.dp_size
    plain = estimate_memory(cfg.model, dims, ParallelOptions(), local_params=expected, seq_len=data.seq_len,
                            micro_batch=per_rank)  # fmt: skip
    assert not plain.fits(H100_GIB), plain.gib()


def _trace_layouts(cfg_overrides: list[list[str]]) -> list[list[int]]:
    """Rank 0 and the last rank of each layout, traced one after the other in this one process."""
    from lightning_dist.plan.trace import trace_rank

    found = []
    for overrides in cfg_overrides:
        cfg = compose_config(overrides)
        world = cfg.cluster.devices * cfg.cluster.num_nodes
        found.append([trace_rank(cfg, rank).local_params for rank in (0, world - 1)])
    return found


def test_the_planner_counts_what_a_traced_rank_holds() -> None:
    """The planner's per-rank parameters (the larger pipeline stage) against ranks traced through the real
    parallelize path: llama 70B's shape on 64 ranks (tp8 x dp_shard8 is the recipe test's above)."""
    from lightning_dist.plan.cost import rank_params

    model = ["model=llama_70b", "cluster=node_8gpu", "cluster.num_nodes=8"]
    layouts = {
        (1, 64, 1): [*model, "parallelism=fsdp"],
        (4, 4, 4): [*model, "parallelism=3d", "parallelism.tp=4", "parallelism.pp=4", "parallelism.microbatches=4"],
    }
    traced = launch(_trace_layouts, 1, list(layouts.values()))[0]
    cfg = compose_config(model)
    for (tp, dp_shard, pp), (first, last) in zip(layouts, traced):
        per_rank = [params / (tp * dp_shard) for params in rank_params(cfg.model, pp)]
        assert first == pytest.approx(per_rank[0], rel=0.01), (tp, dp_shard, pp, first, per_rank)
        assert last == pytest.approx(per_rank[-1], rel=0.01), (tp, dp_shard, pp, last, per_rank)
