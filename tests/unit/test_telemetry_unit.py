"""Telemetry pieces without a process group: peaks, token counting, bus factors, one-process run into W&B offline."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dist.telemetry import OpStats, Telemetry
from lightning_dist.telemetry.comm import BUS_FACTORS
from lightning_dist.telemetry.tables import format_summary
from lightning_dist.telemetry.throughput import batch_size_and_tokens, find_flops_per_token, peak_tflops


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
        ("NVIDIA H200", "bf16-true", 989.4),
        ("NVIDIA H100 PCIe", "bf16-mixed", 756.0),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0),
        ("NVIDIA A100-SXM4-80GB", "32-true", 19.5),  # float32 matmul precision "highest": no TF32
        ("Some CPU", "bf16-mixed", None),
    ],
)
def test_peak_table(name: str, precision: str, expected: float | None) -> None:
    assert peak_tflops(name, precision) == expected


def test_bus_factors_follow_nccl_tests() -> None:
    assert BUS_FACTORS["all_reduce"](4) == 1.5  # 2 (n - 1) / n
    assert BUS_FACTORS["all_gather"](4) == 0.75  # (n - 1) / n
    assert BUS_FACTORS["reduce_scatter"](2) == 0.5
    assert OpStats(count=2, bytes=2 * 10**9, seconds=0.5, timed_count=1, timed_bus_bytes=1.5e9).busbw_gbps == 3.0


def test_tokens_of_a_batch() -> None:
    inputs = torch.zeros(4, 16, dtype=torch.long)
    assert batch_size_and_tokens((inputs, inputs)) == (4, 64)
    assert batch_size_and_tokens({"labels": inputs[:1], "input_ids": inputs}) == (4, 64)
    assert batch_size_and_tokens(inputs) == (4, 64)
    assert batch_size_and_tokens({"x": "no tensor"}) == (0, 0)


def test_flops_per_token_from_the_module_or_its_model() -> None:
    class Model(nn.Module):
        def flops_per_token(self, seq_len: int) -> float:
            return 100.0 + seq_len

    module = nn.Module()
    module.model = Model()
    assert find_flops_per_token(module, 28) == 128.0
    assert find_flops_per_token(nn.Module(), 28) is None


def test_summary_prints_every_row() -> None:
    text = format_summary({"comm": (["axis", "op"], [["dp", "all_reduce"], ["tp", "all_gather"]])}, 3)
    assert "all_reduce" in text and "all_gather" in text and "3 optimizer steps" in text


class _Regression(pl.LightningModule):
    flops_per_token = 1e6

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_one_process(module: pl.LightningModule, telemetry: Telemetry, validate: bool = False, **trainer_kwargs):
    """Four optimizer steps of ``module`` on random regression data, in this process, with ``telemetry``."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), 4)
    trainer_kwargs.setdefault("logger", False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[telemetry],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, data, data if validate else None)


def test_one_process_run_logs_to_wandb_offline(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(save_dir=str(tmp_path), project="telemetry-test", offline=True)
    telemetry = Telemetry(log_every_n_steps=2, peak_tflops=1.0, print_summary=False)
    _fit_one_process(_Regression(), telemetry, logger=logger)
    summary = {key: logger.experiment.summary[key] for key in logger.experiment.summary.keys()}  # noqa: SIM118
    for key in ("perf/step_ms", "perf/tokens_per_sec", "perf/mfu", "memory/rss_gib"):
        assert key in summary, key
    assert summary["perf/samples_per_sec"] == pytest.approx(telemetry.history[-1]["perf/samples_per_sec"])
    assert [row["step"] for row in telemetry.history] == [2, 4]
    assert not any(key.startswith("comm/") for key in telemetry.history[-1])  # one process: nothing to track
    assert telemetry.tables["layout"] == (["rank", "dp"], [[0, 0]])
    logger.experiment.finish()


class _SlowValidation(_Regression):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        time.sleep(VAL_SLEEP)


VAL_SLEEP = 0.3


def test_validation_time_is_no_part_of_the_training_step() -> None:
    telemetry = Telemetry(log_every_n_steps=2, print_summary=False)
    _fit_one_process(
        _SlowValidation(), telemetry, validate=True, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0
    )
    # The second window (steps 3-4) comes right after a validation run of VAL_SLEEP: counted in, it would add
    # VAL_SLEEP / 2 steps = 150 ms to every time below; a step of this model takes about a millisecond.
    window = telemetry.history[1]
    assert window["perf/step_ms"] < VAL_SLEEP * 1e3 / 10
    assert window["perf/data_ms"] < VAL_SLEEP * 1e3 / 10


class _NoFlops(_Regression):
    flops_per_token = None  # states nothing: the telemetry estimates 6 x parameters and says so


def test_flops_are_estimated_from_parameters_when_the_module_states_none() -> None:
    telemetry = Telemetry(log_every_n_steps=2, peak_tflops=1.0, print_summary=False)
    _fit_one_process(_NoFlops(), telemetry)
    row = telemetry.history[-1]
    assert row["perf/flops_estimated"] == 1.0
    params = 8 + 1  # nn.Linear(8, 1)
    assert row["perf/tflops_per_device"] == pytest.approx(6 * params * row["perf/tokens_per_sec"] / 1e12)
    stated = Telemetry(log_every_n_steps=2, peak_tflops=1.0, print_summary=False)
    _fit_one_process(_Regression(), stated)
    assert "perf/flops_estimated" not in stated.history[-1]


@pytest.mark.parametrize("tied", [False, True])
def test_a_huggingface_llama_counts_the_flops_of_the_same_shape_gpt(tied: bool) -> None:
    """The telemetry's MFU of model=hf: the same FLOPs per token as the built-in GPT of the same shape (6N without
    embeddings, plus attention's 12 L H Q T), not 6 x every parameter (which left attention out: -9% on a 1B)."""
    from transformers import LlamaConfig

    from lightning_dist.models.gpt import GPT, GPTConfig
    from lightning_dist.models.hf import HFCausalLM

    gpt = GPT(GPTConfig(vocab_size=256, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                        tie_embeddings=tied))  # fmt: skip
    hf = HFCausalLM(LlamaConfig(vocab_size=256, num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied))  # fmt: skip
    assert hf.flops_per_token(128) == gpt.flops_per_token(128)
