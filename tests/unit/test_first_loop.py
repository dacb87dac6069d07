"""Small things a newcomer's first half hour met (issue 44): what the summary says when no validation ran, the
callbacks a user's own Trainer imports, and the docs' claims the code no longer makes."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST, compose_config

from lightning_dist.run.result import RunResult
from lightning_dist.run.train import _print_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("overrides", "steps", "why"),
    [
        (FAST, 10, "validation off: trainer.limit_val_batches=0"),
        ([], 5, "no validation ran: it runs every trainer.val_check_interval=100 steps; the run took 5"),
    ],
)
def test_the_summary_says_why_there_is_no_val_loss(
    overrides: list[str], steps: int, why: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = RunResult(output_dir=str(tmp_path), layout="ddp", steps=steps, train_loss=2.0, wall_time_s=1.0)
    _print_summary(result, compose_config(overrides))
    assert f"val/loss      : - ({why})\n" in capsys.readouterr().out


def test_lora_in_a_users_own_trainer_trains_the_adapters_only() -> None:
    """The Python entry point for LoRA (no app, no Hydra): a transformers model in HFCausalLM with a LoraConfig, fit by
    Lightning's own single-device strategy."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import torch
    from helpers import quiet_trainer
    from torch.utils.data import DataLoader

    from lightning_dist.models import HFCausalLM, LoraConfig
    from lightning_dist.models.lora import base_name

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(vocab_size=64, num_hidden_layers=2, max_position_embeddings=32, **sizes)
    net = transformers.LlamaForCausalLM(config)
    before = {name: param.detach().clone() for name, param in net.named_parameters()}
    module = HFCausalLM(net, lora=LoraConfig(rank=4, targets=["q_proj", "v_proj"]), lr=1e-2)
    trainer = quiet_trainer("auto", devices=1, max_steps=3)
    trainer.fit(module, DataLoader(torch.randint(0, 64, (12, 17)), batch_size=4))
    params = dict(module.model.named_parameters())
    adapters = {name for name in params if ".lora_" in name}
    assert len(adapters) == 2 * 2 * config.num_hidden_layers  # A and B of q_proj and v_proj in each block
    assert {name for name, param in params.items() if param.requires_grad} == adapters
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(params[name]) for name in adapters}
    for name, param in params.items():
        if name in adapters:
            assert ".lora_A." in name or param.abs().max() > 0, name  # B starts at zero: trained
        else:
            assert torch.equal(param, before[base_name(name)]), name  # the base is frozen


def test_a_users_trainer_imports_evalcallback_with_the_other_callbacks() -> None:
    import lightning_dist.callbacks as callbacks
    from lightning_dist.callbacks.evaluation import EvalCallback

    assert callbacks.EvalCallback is EvalCallback and "EvalCallback" in callbacks.__all__
