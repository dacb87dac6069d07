"""The traced check: one rank stepped on fake tensors over the fake backend issues exactly the collectives the
planner counts, and holds the gradient and AdamW bytes it predicts (the layout tests compare the same counts with
real CPU runs)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import FAST, compose_config

from lightning_dist.launch import launch

LAYOUTS = {
    "tp2xfsdp2": ["parallelism=tp_fsdp", "cluster.devices=4"],
    "tp2-mb2-bf16": ["parallelism=tp", "cluster.devices=2", "data.micro_batch_size=2", "cluster.precision=bf16-mixed"],
    "tp2xfsdp2-mb2-bf16": ["parallelism=tp_fsdp", "cluster.devices=4", "data.micro_batch_size=2",
                           "cluster.precision=bf16-mixed"],
    "tp2xfsdp2-bf16": ["parallelism=tp_fsdp", "cluster.devices=4", "cluster.precision=bf16-mixed"],
    "hsdp2x2-full": ["parallelism=fsdp", "cluster.devices=4", "parallelism.dp_replicate=2", "parallelism.dp_shard=2",
                     "parallelism.activation_checkpointing=full"],
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
    from lightning_dist.app import build_parallel_dims
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


WIDE = ["model.d_model=512", "model.n_heads=8", "model.max_seq_len=1024", "data.seq_len=1024", "cluster.devices=1",
        "parallelism=fsdp", "data.global_batch_size=2", "cluster.precision=bf16-mixed", "model.n_layers=1"]  # fmt: skip


def _peaks(configs: list[Any]) -> list[int]:
    from lightning_dist.plan.trace import trace_rank

    return [trace_rank(cfg, 0, step=True, memory=True).peak_bytes for cfg in configs]


def test_the_planned_bytes_per_logit_are_what_torch_allocates() -> None:
    """The peak's change with the vocabulary, the model states' share taken off, is the loss head's bytes per logit."""
    from lightning_dist.plan.memory import LOGIT_BYTES

    small, large = (compose_config([*FAST, *WIDE, f"model.vocab_size={v}"]) for v in (8192, 16384))
    low, high = launch(_peaks, 1, [small, large])[0]
    states = 2 * (16384 - 8192) * 512 * 16  # embedding and head rows: fp32 weights, gradients, AdamW moments
    logits = 2 * 1024 * (16384 - 8192)
    assert (high - low - states) / logits == pytest.approx(LOGIT_BYTES, rel=0.1)
