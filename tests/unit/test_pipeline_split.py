"""Pipeline splitting and the checks made before training (no process group)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from helpers import FAST, compose_config
from torch import nn

from lightning_dist import PipelineParallelStrategy
from lightning_dist.config.validate import validate
from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.parallel.pipeline import (
    PipelineSpec,
    balanced_split,
    block_costs,
    prune_model,
    split_at,
    stage_ids,
    stage_view,
)

GPT_SPEC = PipelineSpec("model", "layers", ("tok_emb", "pos_emb"), ("norm", "head"))


def test_balanced_split_minimizes_the_largest_stage() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert balanced_split([1, 1, 1, 5], 3)[-1] == [3]  # the heavy block alone; max stage cost 5
    with pytest.raises(ValueError, match="3 pipeline stages for 2 blocks"):
        balanced_split([1, 1], 3)


def test_embedding_and_head_count_in_the_split() -> None:
    cfg = GPTConfig(vocab_size=4096, n_layers=6, d_model=32, n_heads=4, max_seq_len=16)
    with torch.device("meta"):
        model = GPT(cfg)
    keys, costs = block_costs(model, GPT_SPEC)
    assert keys == [str(i) for i in range(6)]
    assert costs[0] > 10 * costs[1] and costs[-1] > 10 * costs[1]  # a vocab x d_model matrix at each end
    groups = balanced_split(costs, 3)
    assert groups[0] == [0] and groups[-1] == [5]  # the big ends get fewer blocks


def test_manual_split_points_by_module_name() -> None:
    keys = [str(i) for i in range(4)]
    assert split_at(keys, "layers", ["layers.1"], 2) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match=r"'layers\.9' is not a block"):
        split_at(keys, "layers", ["layers.9"], 2)
    with pytest.raises(ValueError, match="give 1 split point"):
        split_at(keys, "layers", ["layers.1", "layers.2"], 2)


def test_stage_placement() -> None:
    assert stage_ids(0, 2, 2, "Interleaved1F1B") == [0, 2]
    assert stage_ids(1, 2, 2, "Interleaved1F1B") == [1, 3]
    assert stage_ids(0, 2, 2, "ZBVZeroBubble") == [0, 3]
    assert stage_ids(1, 2, 1, "1F1B") == [1]


def test_stage_keeps_full_names_and_equals_the_full_models_slice() -> None:
    cfg = GPTConfig(vocab_size=64, n_layers=4, d_model=32, n_heads=4, max_seq_len=16)
    full = GPT(cfg)
    full.init_weights(7)
    with torch.device("meta"):
        stage = GPT(cfg)
    prune_model(stage, GPT_SPEC, {"2", "3"}, first=False, last=True)
    stage.to_empty(device="cpu")
    stage.init_weights(7)
    names = dict(stage.named_parameters())
    assert all(name.startswith(("layers.2.", "layers.3.", "norm.", "head.")) for name in names)
    reference = dict(full.named_parameters())
    for name, param in names.items():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=0)
    hidden = torch.randn(2, 8, 32)
    partial = GPT(cfg)
    partial.init_weights(7)
    prune_model(partial, GPT_SPEC, {"0", "1"}, first=True, last=False)
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(stage(partial(tokens)), full(tokens))
    assert hidden.shape == partial(tokens).shape


def test_views_of_a_sequential_keep_original_keys() -> None:
    net = nn.Sequential(OrderedDict([("embed", nn.Embedding(8, 4)), ("b0", nn.Linear(4, 4)), ("b1", nn.Linear(4, 4))]))
    spec = PipelineSpec("net")
    view = stage_view(net, spec, ["b0", "b1"], first=False, last=True)
    assert [name for name, _ in view.named_parameters()] == ["b0.weight", "b0.bias", "b1.weight", "b1.bias"]
    assert len(net) == 3  # the model itself is untouched


# ----------------------------------------------------------------------------------------------------- errors
def _check(*overrides: str) -> None:
    validate(compose_config([*FAST, "parallelism=pp", "cluster.devices=2", *overrides]))


def test_pp_greater_than_the_number_of_blocks() -> None:
    with pytest.raises(ValueError, match=r"= 4 stages but the model has 2 blocks"):
        _check(
            "parallelism.pipeline.schedule=Interleaved1F1B",
            "parallelism.pipeline.stages_per_rank=2",
            "parallelism.pipeline.microbatches=4",
        )


def test_microbatches_must_divide_the_per_rank_batch() -> None:
    with pytest.raises(ValueError, match=r"microbatches=3 does not divide the per-rank batch 8"):
        _check("parallelism.pipeline.microbatches=3")


def test_too_few_microbatches() -> None:
    with pytest.raises(ValueError, match=r"1F1B needs microbatches >= pp=2 \(got 1\)"):
        _check("parallelism.pipeline.microbatches=1")
    with pytest.raises(ValueError, match=r"DualPipeV needs microbatches >= number of stages 4 \(got 2\)"):
        _check("model.n_layers=4", "parallelism.pipeline.schedule=DualPipeV", "parallelism.pipeline.stages_per_rank=2",
               "parallelism.pipeline.microbatches=2")  # fmt: skip


def test_schedule_and_stages_per_rank_must_agree() -> None:
    with pytest.raises(ValueError, match=r"multi-stage schedule and needs stages_per_rank>=2"):
        PipelineParallelStrategy(pp=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match=r"schedule=1F1B runs one stage per rank but stages_per_rank=2"):
        PipelineParallelStrategy(pp=2, schedule="1F1B", stages_per_rank=2)


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'Zigzag' is unknown; use one of GPipe, 1F1B, Interleaved1F1B"):
        _check("parallelism.pipeline.schedule=Zigzag")


def test_registered_in_lightning() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry.get("pipeline_parallel").parallelism.pipeline.schedule == "1F1B"
