"""The 8B and 70B recipes can start: ranks of their real world size, traced on torch's fake process-group backend
through the strategy's own parallelize path, hold exactly their share of the model, and the per-rank estimate of
parameters + gradients + optimizer + activations + buffers fits an 80 GB H100.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config

from lightning_dist.launch import launch
from lightning_dist.models.gpt import GPT
from lightning_dist.plan.memory import count_local_params, estimate_memory

H100_GIB = 79.6  # 81559 MiB as nvidia-smi reports it
RECIPES = ["llama_8b_tp_fsdp_8gpu", "llama_70b_tp_fsdp_64gpu"]


def _trace(recipe: str, rank: int):
    from lightning_dist.plan.trace import trace_rank

    return trace_rank(compose_config([f"recipe={recipe}"]), rank)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_ranks_hold_their_share_and_fit_an_h100(recipe: str) -> None:
    from lightning_dist.app import build_parallel_dims

    cfg = compose_config([f"recipe={recipe}"])
    dims = build_parallel_dims(cfg)
    par, data = cfg.parallelism, cfg.data
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
            local_params=trace.local_params,
            seq_len=data.seq_len,
            micro_batch=data.micro_batch_size,
            tp=dims.tp,
            dp_shard=dims.dp_shard,
            activation_checkpointing=par.activation_checkpointing,
            ac_selective=par.ac_selective,
        )
        assert estimate.fits(H100_GIB), estimate.gib()
    # What the recipe settings buy: the whole per-rank batch in one forward, nothing recomputed, would not fit.
    per_rank = data.global_batch_size // dims.dp_size
    plain = estimate_memory(cfg.model, local_params=expected, seq_len=data.seq_len, micro_batch=per_rank, tp=dims.tp)
    assert not plain.fits(H100_GIB), plain.gib()
