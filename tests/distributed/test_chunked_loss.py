"""``loss_chunks``: the head and cross-entropy in pieces of the tokens, recomputed in the backward, give the plain
loss's curve (rtol 1e-5) under every layout they claim: FSDP2, TP with sequence and loss parallelism (vocab-sharded
logits), the last pipeline stage, context parallelism and Lightning's DDP, for the built-in GPT (masked SFT batches
too) and a HuggingFace Llama. One spawned group of two ranks runs every case."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import GradNorms, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.hf import HFCausalLM
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig
from lightning_dist.run.launch import launch
from lightning_dist.strategies import DataParallelStrategy

STEPS, BATCH, SEQ, CHUNKS = 4, 4, 32, 3  # 3 pieces of 128 tokens: uneven (43, 43, 42)
MODEL = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)


def _batches(masked: bool, dp: int) -> DataLoader:
    """``STEPS`` global batches (a loader's batch is per data-parallel rank: ours deal each global batch out);
    ``masked``: a third of the targets ``-100`` and each global batch's ``(G, N)`` rows."""
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if not masked:
        return DataLoader(TensorDataset(inputs, targets), batch_size=BATCH // dp)
    targets[torch.rand(targets.shape, generator=torch.Generator().manual_seed(2)) < 0.33] = -100
    counted = (targets != -100).view(STEPS, -1).sum(1).repeat_interleave(BATCH)  # N of each sample's global batch
    norm = torch.stack([torch.full_like(counted, BATCH), counted], dim=1)
    return DataLoader(TensorDataset(inputs, targets, norm), batch_size=BATCH // dp)


def _hf_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _fit(strategy: Any, devices: int, model: str = "gpt", masked: bool = False, dp: int = 1) -> dict[str, Any]:
    if model == "gpt":
        module = GPTModule(MODEL, OptimConfig(lr=1e-2, warmup_steps=0), STEPS)
    else:
        module = HFCausalLM(_hf_llama(), lr=1e-2)
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train/loss"]))

    norms = GradNorms()
    trainer = quiet_trainer(strategy, devices, STEPS, callbacks=[Record(), norms])
    trainer.fit(module, _batches(masked, dp))
    result = {"losses": losses, "norms": norms.values, "chunks": module.loss_chunks}
    pipeline = getattr(trainer.strategy, "pipeline", None)
    if model == "gpt" and (devices == 1 or pipeline is not None):
        # Calling the model outside the loss gives logits: under pp the last stage returns hidden states and the
        # pipelined model applies the head (PipelineSpec.head).
        probe = _batches(False, 1).dataset.tensors[0][:2]
        with torch.no_grad():
            result["logits"] = (pipeline.forward(probe) if pipeline is not None else module.model(probe)).numpy()
    return result


#: name -> (model, masked batches, data-parallel ranks, the strategy)
CASES: dict[str, tuple[str, bool, int, Any]] = {
    "fsdp2-masked": ("gpt", True, 2, lambda: MeshStrategy(dp_shard=2, loss_chunks=CHUNKS)),
    "tp2": ("gpt", False, 1, lambda: TensorParallelStrategy(tp=2, loss_chunks=CHUNKS)),  # SP + loss parallelism
    "tp2-masked": ("gpt", True, 1, lambda: TensorParallelStrategy(tp=2, loss_chunks=CHUNKS)),
    "tp2-no-sp": ("gpt", False, 1, lambda: TensorParallelStrategy(tp=2, sequence_parallel=False, loss_chunks=CHUNKS)),
    "pp2-masked": (
        "gpt",
        True,
        1,
        lambda: PipelineParallelStrategy(pp=2, dp_shard=1, microbatches=2, loss_chunks=CHUNKS),
    ),
    "cp2": ("gpt", False, 1, lambda: MeshStrategy(cp=2, dp_shard=1, loss_chunks=CHUNKS)),
    "ddp2-masked": ("gpt", True, 2, lambda: DataParallelStrategy(parallelism=_options(loss_chunks=CHUNKS))),
    "hf-fsdp2": ("hf", False, 2, lambda: MeshStrategy(dp_shard=2, loss_chunks=CHUNKS)),
    "hf-tp2": ("hf", False, 1, lambda: TensorParallelStrategy(tp=2, loss_chunks=CHUNKS)),
}


def _options(**fields: Any) -> Any:
    from lightning_dist.parallel.options import Parallelism

    return Parallelism().with_fields(**fields)


def _two_ranks() -> dict[str, Any]:
    return {name: _fit(make(), 2, model, masked, dp) for name, (model, masked, dp, make) in CASES.items()}


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """The plain loss (whole logits) in one process: the reference of every case."""
    return {(model, masked): _fit(MeshStrategy(dp_shard=1), 1, model, masked)
            for model, masked in {(m, k) for m, k, _, _ in CASES.values()}}  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_gives_the_plain_curve(case: str, two_ranks: list[dict[str, Any]], one_process) -> None:
    model, masked, _, _ = CASES[case]
    reference = one_process[(model, masked)]
    assert reference["chunks"] == 0
    for rank in two_ranks:
        result = rank[case]
        assert result["chunks"] == CHUNKS  # the strategy set the module's chunked loss
        np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
        np.testing.assert_allclose(result["norms"], reference["norms"], rtol=1e-5)
        if "logits" in result:  # the same weights after the same curve: the same outputs
            np.testing.assert_allclose(result["logits"], reference["logits"], rtol=1e-4, atol=1e-5)


def test_chunked_loss_is_refused_where_it_cannot_run() -> None:
    from helpers import FAST, compose_config

    from lightning_dist.config.validate import validate
    from lightning_dist.contract import configure_loss_chunks

    with pytest.raises(ValueError, match=r"parallelism.loss_chunks=-1 must be >= 0"):
        validate(compose_config([*FAST, "parallelism.loss_chunks=-1"]))
    with pytest.raises(ValueError, match=r"parallelism.loss_chunks=2 with parallelism.pp=2: HFCausalLM's stages"):
        hf = [o for o in FAST if not o.startswith("model.")]
        validate(compose_config([*hf, "model=hf", "parallelism=pp", "parallelism.loss_chunks=2"]))
    with pytest.raises(ValueError, match=r"loss_chunks=4 but LightningModule has no set_loss_chunks\(\)"):
        configure_loss_chunks(pl.LightningModule(), 4)
