"""The traced check: one rank stepped on fake tensors over the fake backend issues exactly the collectives the
planner counts, and holds the gradient and AdamW bytes it predicts (the layout tests compare the same counts with
real CPU runs)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import FAST, compose_config

from lightning_dist.run.launch import launch

LAYOUTS = {
    "tp2xfsdp2": ["parallelism=tp_fsdp", "cluster.devices=4"],
    "tp2-mb2-bf16": ["parallelism=tp", "cluster.devices=2", "data.micro_batch_size=2", "cluster.precision=bf16-mixed"],
    "tp2xfsdp2-mb2-bf16": ["parallelism=tp_fsdp", "cluster.devices=4", "data.micro_batch_size=2",
                           "cluster.precision=bf16-mixed"],
    "tp2xfsdp2-bf16": ["parallelism=tp_fsdp", "cluster.devices=4", "cluster.precision=bf16-mixed"],
    "hsdp2x2-full": ["parallelism=fsdp", "cluster.devices=4", "parallelism.dp_replicate=2", "parallelism.dp_shard=2",
                     "parallelism.activation_checkpointing.mode=full"],
}  # fmt: skip


def _trace_all(configs: dict[str, Any]) -> dict[str, Any]:
    from lightning_dist.plan.trace import trace_rank

    return {name: trace_rank(cfg, 0, step=True) for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def traced() -> dict[str, Any]:
    configs = {name: compose_config([*FAST, *layout]) for name, layout in LAYOUTS.items()}
    return {"configs": configs, "ranks": launch(_trace_all, 1, configs)[0]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_traced_rank_issues_the_planned_collectives(name: str, traced: dict[str, Any]) -> None:
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.collectives import per_axis, step_collectives
    from lightning_dist.plan.cost import estimate
    from lightning_dist.plan.estimate_run import layout_of

    cfg, rank = traced["configs"][name], traced["ranks"][name]
    layout = layout_of(cfg, build_parallel_dims(cfg))
    planned = step_collectives(cfg.model, layout, cfg.data.seq_len, cfg.cluster.precision, stage=0, loop=False)
    assert rank.collectives == per_axis(planned)
    memory = estimate(cfg.model, layout, cfg.hardware, cfg.data.seq_len, cfg.data.global_batch_size).memory
    assert rank.param_bytes == pytest.approx(memory.params, rel=0.05)
    assert rank.optimizer_bytes == pytest.approx(memory.optimizer, rel=0.05)


WIDE = [
    "model=llama_8b",
    "model.max_seq_len=8192",
    "data.seq_len=8192",
    "cluster.devices=1",
    "parallelism=fsdp",
    "data.global_batch_size=2",
    "cluster.precision=bf16-mixed",
]  # Llama 3 8B's widths; fake tensors cost nothing
TOKENS = 2 * 8192


def _peaks(configs: list[Any]) -> list[int]:
    from lightning_dist.plan.trace import trace_rank

    return [trace_rank(cfg, 0, step=True, memory=True).peak_bytes for cfg in configs]


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    """MemTracker's peak of one step of an 8B-wide GPT: the base, the vocabulary doubled, a second block."""
    selective = [
        "parallelism.activation_checkpointing.mode=selective",
        "data.global_batch_size=16",
    ]  # activations dominate
    op_half = "parallelism.activation_checkpointing.selective=op_half"
    runs = {"base": ["model.vocab_size=8192", "model.n_layers=1"],
            "vocab": ["model.vocab_size=16384", "model.n_layers=1"],
            "block": ["model.vocab_size=8192", "model.n_layers=2"],
            "selective": ["model.vocab_size=8192", "model.n_layers=1", *selective],
            "selective_block": ["model.vocab_size=8192", "model.n_layers=2", *selective],
            "op_half": ["model.vocab_size=8192", "model.n_layers=1", *selective, op_half],
            "op_half_block": ["model.vocab_size=8192", "model.n_layers=2", *selective, op_half]}  # fmt: skip
    configs = [compose_config([*FAST, *WIDE, *extra]) for extra in runs.values()]
    return dict(zip(runs, launch(_peaks, 1, configs)[0]))


def test_the_planned_bytes_per_logit_are_what_torch_allocates(peaks: dict[str, int]) -> None:
    """The peak's change with the vocabulary, the model states' share taken off, is the loss head's bytes per logit."""
    from lightning_dist.plan.memory import LOGIT_BYTES

    states = 2 * (16384 - 8192) * 4096 * 16  # embedding and head rows: fp32 weights, gradients, AdamW moments
    logits = TOKENS * (16384 - 8192)
    assert (peaks["vocab"] - peaks["base"] - states) / logits == pytest.approx(LOGIT_BYTES, rel=0.1)


@pytest.mark.parametrize("mode", ["none", "selective", "op_half"])
def test_the_planned_activations_of_a_block_are_what_torch_allocates(mode: str, peaks: dict[str, int]) -> None:
    """The peak's change with one more block, its model states taken off, is what the block keeps for backward."""
    from lightning_dist.models.gpt import GPTConfig
    from lightning_dist.plan.memory import ACT_BYTES, block_activation_elements, block_params

    cfg = GPTConfig(vocab_size=8192, n_layers=2, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336)
    states = block_params(cfg) * 16
    one, two = {"none": ("base", "block")}.get(mode, (mode, f"{mode}_block"))
    tokens = TOKENS * (1 if mode == "none" else 8)
    measured = (peaks[two] - peaks[one] - states) / (tokens * ACT_BYTES)
    planned = block_activation_elements(
        cfg, 1, *(("none",) if mode == "none" else ("selective", mode.replace("selective", "op")))
    )
    assert measured == pytest.approx(planned, rel=0.05)
