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
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.parallel.options import Parallelism

    cfg = compose_config([f"recipe={recipe}"])
    dims, options = build_parallel_dims(cfg), cfg.parallelism
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
    plain = estimate_memory(cfg.model, dims, Parallelism(), local_params=expected, seq_len=data.seq_len,
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
        (4, 4, 4): [
            *model,
            "parallelism=3d",
            "parallelism.tp=4",
            "parallelism.pp=4",
            "parallelism.pipeline.microbatches=4",
        ],
    }
    traced = launch(_trace_layouts, 1, list(layouts.values()))[0]
    cfg = compose_config(model)
    for (tp, dp_shard, pp), (first, last) in zip(layouts, traced):
        per_rank = [params / (tp * dp_shard) for params in rank_params(cfg.model, pp)]
        assert first == pytest.approx(per_rank[0], rel=0.01), (tp, dp_shard, pp, first, per_rank)
        assert last == pytest.approx(per_rank[-1], rel=0.01), (tp, dp_shard, pp, last, per_rank)


def _trace_hf_recipe(overrides: list[str], ranks: tuple[int, ...]) -> list[int]:
    from lightning_dist.plan.trace import trace_rank

    cfg = compose_config(overrides)
    return [trace_rank(cfg, rank).local_params for rank in ranks]


def test_the_finetune_recipe_traces_at_full_size_and_fits(tmp_path) -> None:
    """llama_8b_finetune_8gpu: Llama 3.1 8B as a HuggingFace model (its config.json only: nothing is allocated or
    downloaded), ranks 0 and 7 of the real fsdp8 layout traced on the fake backend through the strategy's own
    parallelize path hold 1/8 of the model, and the planner's estimate of the recipe's settings fits an H100."""
    from transformers import LlamaConfig

    from lightning_dist.config.build import planned_model
    from lightning_dist.config.validate import build_parallel_dims

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False).save_pretrained(tmp_path)  # fmt: skip
    overrides = ["recipe=llama_8b_finetune_8gpu", "model.pretrained=null", f"model.config={tmp_path}",
                 f"data.path={tmp_path / 'sft.jsonl'}"]  # fmt: skip
    cfg = compose_config(overrides)
    dims, options = build_parallel_dims(cfg), cfg.parallelism
    model = planned_model(cfg.model)
    expected = count_local_params(model, dp_shard=dims.dp_shard)
    assert expected * dims.dp_shard == pytest.approx(8.03e9, rel=0.01)  # a 1/8 share of Llama 3.1 8B
    traced = launch(_trace_hf_recipe, 1, overrides, (0, dims.world_size - 1))[0]
    assert traced == [pytest.approx(expected, rel=1e-3)] * 2, (traced, expected)
    estimate = estimate_memory(model, dims, options, local_params=expected, seq_len=cfg.data.seq_len,
                               micro_batch=cfg.data.micro_batch_size)  # fmt: skip
    assert estimate.fits(H100_GIB), estimate.gib()
    assert estimate.gib()["total"] == pytest.approx(45.4, abs=0.1)  # the number the recipe states (loss_chunks=8)


def _trace_lora_step(overrides: list[str]) -> tuple[int, int, int]:
    from lightning_dist.plan.trace import trace_rank

    trace = trace_rank(compose_config(overrides), 0, step=True)
    return trace.local_params, trace.grad_bytes, trace.optimizer_bytes


def test_the_lora_recipe_plans_state_for_the_adapters_only_on_8_gpus_and_on_1(tmp_path) -> None:
    """llama_8b_lora_chat: rank 0 of its fsdp8 layout, built at full size (Llama 3.1 8B's config.json) with its
    rank-16 adapters and stepped once on fake tensors, holds 1/8 of the base and adapters, and gradients and AdamW
    state for the adapters only, as the planner counts them; the planner's totals are the recipe's (8 GPUs, 1 GPU)."""
    from transformers import LlamaConfig

    from lightning_dist.config.build import planned_model
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.memory import lora_block_params

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False).save_pretrained(tmp_path)  # fmt: skip
    overrides = ["recipe=llama_8b_lora_chat", "model.pretrained=null", f"model.config={tmp_path}",
                 f"data.path={tmp_path / 'chats.jsonl'}"]  # fmt: skip
    cfg = compose_config(overrides)
    dims, options = build_parallel_dims(cfg), cfg.parallelism
    model = planned_model(cfg.model)
    adapters = model.n_layers * lora_block_params(model)
    assert adapters == 41_943_040  # rank 16 on q, k, v, o, gate, up, down of 32 layers
    base = count_local_params(model, dp_shard=dims.dp_shard)
    estimate = estimate_memory(model, dims, options, local_params=base, seq_len=cfg.data.seq_len,
                               micro_batch=cfg.data.micro_batch_size)  # fmt: skip
    local, grad_bytes, optimizer_bytes = launch(_trace_lora_step, 1, overrides)[0]
    assert local == pytest.approx(base + adapters / 8, rel=1e-3)
    assert grad_bytes == pytest.approx(estimate.grads, rel=1e-3)  # fp32 adapter gradients, 1/8 of them
    assert optimizer_bytes == pytest.approx(estimate.optimizer, rel=1e-3)  # AdamW's two moments, adapters only
    assert estimate.gib()["total"] == pytest.approx(28.8, abs=0.1)  # the numbers the recipe states
    one = compose_config([*overrides, "cluster.devices=1", "data.micro_batch_size=2"])
    single = estimate_memory(model, build_parallel_dims(one), one.parallelism, local_params=base * 8,
                             seq_len=one.data.seq_len, micro_batch=2)  # fmt: skip
    assert single.gib()["total"] == pytest.approx(43.8, abs=0.1) and single.fits(H100_GIB)
