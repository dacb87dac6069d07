"""transformers' MoE families under expert parallelism composed with the other axes, on 4 ranks.

The family matrix checks each axis alone on 2 ranks (``ep2`` for the families whose experts have the stacked
interface, ``models/hf_experts.py``); here the family's own experts code runs with its experts split over ep beside
tensor parallelism (Mixtral: the attention sharded, each tp rank routing its part of the tokens) and beside a
pipeline (Qwen3-MoE: each stage's MoE blocks split their experts), and the losses equal one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.hf_matrix import verdict

from lightning_dist.run.launch import launch

LAYOUTS = {
    "mixtral|ep2xtp2": {"dp_shard": 2, "ep": 2, "tp": 2},
    "qwen3_moe|pp2xep2": {"pp": 2, "dp_shard": 2, "ep": 2},
}


def _ranks() -> dict[str, Any]:
    from support.hf_matrix import fit_losses

    torch.set_num_threads(1)
    return {key: fit_losses(key.split("|")[0], layout, devices=4) for key, layout in LAYOUTS.items()}


def _one_process() -> dict[str, Any]:
    from support.hf_matrix import fit_losses

    torch.set_num_threads(1)
    return {family: fit_losses(family, None) for family in sorted({key.split("|")[0] for key in LAYOUTS})}


@pytest.fixture(scope="module")
def found() -> dict[str, tuple[Any, Any]]:
    one = launch(_one_process, 1)[0]
    ranks = launch(_ranks, 4)[0]
    return {key: (ranks[key], one[key.split("|")[0]]) for key in LAYOUTS}


@pytest.mark.parametrize("key", LAYOUTS)
def test_an_hf_moe_family_with_its_experts_split_over_ep_beside_another_axis_equals_one_process(
    found: dict[str, tuple[Any, Any]], key: str
) -> None:
    losses, reference = found[key]
    assert verdict(losses, reference) == "exact", (losses, reference)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_the_planner_models_an_hf_moe_family_as_the_gpt_with_its_experts(family: str, tmp_path) -> None:
    """``planned_model`` of an MoE family is the GPT with MoE blocks of the same experts: the same parameters, up to
    what the GPT has no place for (Qwen3-MoE's and OLMoE's q / k norms, Qwen2-MoE's q / k / v biases and one-row
    shared-expert gate)."""
    from support.hf_tiny import tiny_config

    from lightning_dist.config.schema import HFModelConfig
    from lightning_dist.config.shapes import planned_model
    from lightning_dist.models.gpt import GPT
    from lightning_dist.models.hf_init import build_causal_lm

    config = tiny_config(family)
    config.save_pretrained(tmp_path)
    planned = planned_model(HFModelConfig(config=str(tmp_path)))
    assert planned.moe.num_experts == build_causal_lm(config).model.layers[0].mlp.experts.num_experts
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPT(planned).parameters())
    theirs = sum(p.numel() for p in build_causal_lm(config).parameters())
    layers, width = config.num_hidden_layers, config.hidden_size
    kv_width = width * config.num_key_value_heads // config.num_attention_heads
    unplaced = {
        "mixtral": 0,
        "qwen2_moe": layers * (width + width + 2 * kv_width),
        "qwen3_moe": layers * 2 * (width // config.num_attention_heads),
        "olmoe": layers * (width + kv_width),
    }[family]
    assert theirs - ours == unplaced, (theirs, ours)
