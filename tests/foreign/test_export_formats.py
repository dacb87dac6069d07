"""``lightning-dist-export`` formats: the built-in GPT as transformers' Llama / GPT-2 and an HF model as itself,
each loaded by transformers with the logits of the module that was saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig

transformers = pytest.importorskip("transformers")


def _gpt_checkpoint(tmp_path: Path, **fields) -> tuple[GPTModule, Path]:
    """A trained-looking GPT (random, not initial values) saved as a single-file Lightning checkpoint."""
    module = GPTModule(GPTConfig(vocab_size=96, d_model=32, n_heads=4, n_layers=2, **fields), OptimConfig(), 10)
    module.configure_model()
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.05 * torch.randn_like(param))  # norms and biases away from 1 / 0, so a swap would show
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return module, path


@pytest.mark.parametrize(
    ("fields", "hf_class"),
    [
        ({"arch": "llama", "n_kv_heads": 2}, "LlamaForCausalLM"),
        ({"arch": "llama", "tie_embeddings": True}, "LlamaForCausalLM"),
        ({"arch": "gpt2"}, "GPT2LMHeadModel"),
    ],
    ids=["llama-gqa", "llama-tied", "gpt2"],
)
def test_the_gpt_exports_to_the_transformers_class_with_equal_logits(fields, hf_class, tmp_path: Path) -> None:
    module, ckpt = _gpt_checkpoint(tmp_path, **fields)
    export_main([str(ckpt), str(tmp_path / "hf"), "--max-shard-size", "20KB"])  # several shards and their index
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [hf_class]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, module(tokens), rtol=1e-5, atol=1e-5)


def test_the_single_file_loads_with_weights_only_into_the_module(tmp_path: Path) -> None:
    module, ckpt = _gpt_checkpoint(tmp_path)
    export_main([str(ckpt), str(tmp_path / "model.pt")])
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    fresh = GPTModule(module.model_config, OptimConfig(), 10)
    fresh.configure_model()
    fresh.load_state_dict(weights)  # strict: every name, no extra
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor, rtol=0, atol=0)


def test_an_hf_model_exports_as_itself(tmp_path: Path) -> None:
    from lightning_dist.models.hf import HFCausalLM

    shape = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = transformers.Qwen2Config(**shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    module = HFCausalLM(lm)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "hf.ckpt")
    export_main([str(tmp_path / "hf.ckpt"), str(tmp_path / "out"), "--dtype", "bfloat16"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():  # bfloat16 weights: equal to bfloat16 rounding
        torch.testing.assert_close(loaded(tokens).logits, lm(tokens).logits, rtol=0.05, atol=0.05)


def test_a_module_of_your_own_exports_to_one_file_only(tmp_path: Path, capsys) -> None:
    torch.save({"state_dict": {"layer.weight": torch.ones(2, 2)}, "hyper_parameters": {"width": 2}}, tmp_path / "c")
    with pytest.raises(SystemExit, match=r"holds neither the built-in GPT nor an HFCausalLM .*--format torch"):
        export_main([str(tmp_path / "c"), str(tmp_path / "hf")])
    export_main([str(tmp_path / "c"), str(tmp_path / "mine.pt")])
    assert torch.load(tmp_path / "mine.pt", weights_only=True)["layer.weight"].sum() == 4
