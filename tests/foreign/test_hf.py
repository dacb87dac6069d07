"""Tiny HuggingFace causal LMs (configs built here, nothing downloaded) under TP and PP against one process."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import GradNorms, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import PipelineParallelStrategy, TensorParallelStrategy
from lightning_dist.models.hf import HFCausalLM
from lightning_dist.run.launch import launch

STEPS, BATCH, SEQ, VOCAB = 8, 4, 16, 64


FAMILIES = ("Llama", "Qwen2", "Mistral", "GPT2")
#: GPT-2 spells its classes and its config differently (and drops out by default: no dropout, for equal curves).
GPT2 = {"n_embd": 32, "n_inner": 64, "n_layer": 2, "n_head": 4, "n_positions": SEQ, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip


def _model(family: str, tied: bool = False) -> torch.nn.Module:
    import transformers

    extra = GPT2 if family == "GPT2" else {}
    config = getattr(transformers, f"{family}Config")(
        **extra,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return getattr(transformers, "GPT2LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM")(config)


def _fit(kind: str, strategy: Any, devices: int) -> dict[str, Any]:
    """``kind``: a family (untied), or "tied" (Llama with tied embeddings)."""
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    # GPT-2 as it ships: its embedding and head tied.
    module = HFCausalLM(_model("Llama", tied=True) if kind == "tied" else _model(kind, kind == "GPT2"), lr=1e-2)
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train/loss"]))

    grad_norms = GradNorms()
    trainer = quiet_trainer(strategy, devices, STEPS, callbacks=[Record(), grad_norms])
    try:
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=BATCH))
    except (ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    inner = module.model.transformer if hasattr(module.model, "transformer") else module.model.model
    head, embed = module.model.lm_head, getattr(inner, "wte", None) or getattr(inner, "embed_tokens", None)
    return {
        "losses": losses,
        "grad_norms": grad_norms.values,
        "tied": head is not None and embed is not None and head.weight is embed.weight,
    }


def _one_process() -> dict[str, Any]:
    return {kind: _fit(kind, "auto", 1) for kind in (*FAMILIES, "tied")}


def _two_ranks() -> dict[str, Any]:
    results = {}
    for family in FAMILIES:
        results[f"{family}_tp"] = _fit(family, TensorParallelStrategy(tp=2), 2)
        results[f"{family}_pp"] = _fit(family, PipelineParallelStrategy(pp=2, microbatches=2), 2)
    results["tied_tp"] = _fit("tied", TensorParallelStrategy(tp=2), 2)
    results["tied_pp"] = _fit("tied", PipelineParallelStrategy(pp=2, microbatches=2), 2)
    return results


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _one_process()  # in this process: a one-process reference needs no spawned rank


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_family_matches_one_process(family: str, layout: str, two_ranks, one_process) -> None:
    for rank in two_ranks:
        run = rank[f"{family}_{layout}"]
        assert "losses" in run, run
        assert len(run["losses"]) == STEPS
        np.testing.assert_allclose(run["losses"], one_process[family]["losses"], rtol=1e-5)
        np.testing.assert_allclose(run["grad_norms"], one_process[family]["grad_norms"], rtol=1e-4)


def test_tied_embeddings_stay_tied_under_tp(two_ranks, one_process) -> None:
    assert one_process["tied"]["tied"]
    for rank in two_ranks:
        assert "losses" in rank["tied_tp"], rank["tied_tp"]
        assert rank["tied_tp"]["tied"]
        np.testing.assert_allclose(rank["tied_tp"]["losses"], one_process["tied"]["losses"], rtol=1e-5)
        np.testing.assert_allclose(rank["tied_tp"]["grad_norms"], one_process["tied"]["grad_norms"], rtol=1e-4)


def test_tied_embeddings_across_pipeline_stages_match_one_process(two_ranks, one_process) -> None:
    for rank in two_ranks:  # embedding on stage 0, head on stage 1: gradients summed over the two, norm counted once
        assert "losses" in rank["tied_pp"], rank["tied_pp"]
        np.testing.assert_allclose(rank["tied_pp"]["losses"], one_process["tied"]["losses"], rtol=1e-5)
        # The tied weight counted once in the norm, as in one process (not once per stage holding a copy).
        np.testing.assert_allclose(rank["tied_pp"]["grad_norms"], one_process["tied"]["grad_norms"], rtol=1e-4)
