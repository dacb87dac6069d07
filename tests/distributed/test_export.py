"""Export a checkpoint written by pp2 x tp2, and start a tensor-parallel run from the exported HuggingFace folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_config, run_app
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig

transformers = pytest.importorskip("transformers")
MODEL = ["model.n_layers=2", "model.n_kv_heads=2", "trainer.enable_checkpointing=true"]
HF = [o for o in FAST if not o.startswith("model.")] + ["model=hf", "model.config=tiny_llama"]


def test_a_pp2_x_tp2_checkpoint_exports_and_a_tensor_parallel_run_starts_from_it(tmp_path: Path) -> None:
    trained = run_app(
        [
            *FAST,
            *MODEL,
            "parallelism=3d",  # pp2 x tp2
            "cluster.devices=4",
            "parallelism.dp_shard=1",
            "trainer.max_steps=3",
            "trainer.enable_checkpointing=true",
        ],
        tmp_path / "a",
    )
    # One file, from the run folder (its newest checkpoint): the same tensors as torch's own DCP -> torch.save.
    export_main([str(tmp_path / "a"), str(tmp_path / "a.pt")])
    dcp_to_torch_save(trained["checkpoint"], tmp_path / "reference.pt")
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)["state_dict"]
    weights = torch.load(tmp_path / "a.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)

    # HuggingFace, in several shards: transformers' Llama gives the trained GPT's logits.
    export_main([trained["checkpoint"], str(tmp_path / "hf"), "--max-shard-size", "40KB"])
    cfg = compose_config([*FAST, *MODEL])
    module = GPTModule(cfg.model if isinstance(cfg.model, GPTConfig) else None, OptimConfig(), 3)
    module.configure_model()
    initial = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    module.load_state_dict(weights)
    assert not torch.equal(initial["model.layers.0.attn.q_proj.weight"], weights["model.layers.0.attn.q_proj.weight"])
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, module(tokens), rtol=1e-5, atol=1e-5)

    # The reverse: tp=2 ranks read their column / row slices of the safetensors; with lr 0 the step changes
    # nothing, so the new run's checkpoint holds exactly the exported weights.
    restarted = run_app(
        [*FAST, *MODEL, "parallelism=tp", "cluster.devices=2", "trainer.max_steps=1", "optim.lr=0",
         "trainer.enable_checkpointing=true", f"init_from={tmp_path / 'hf'}"],
        tmp_path / "b",
    )  # fmt: skip
    export_main([restarted["checkpoint"], str(tmp_path / "b.pt")])
    for name, tensor in torch.load(tmp_path / "b.pt", weights_only=True).items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)


def test_weights_that_do_not_fit_the_model_fail_before_launch(tmp_path: Path) -> None:
    from lightning_dist.config.validate import validate

    module = GPTModule(GPTConfig(n_layers=2, d_model=32, n_heads=4), OptimConfig(), 3)
    module.configure_model()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "small.ckpt")
    export_main([str(tmp_path / "small.ckpt"), str(tmp_path / "hf")])
    with pytest.raises(ValueError, match=r"init_from=.*hf: model.embed_tokens.weight has shape \(256, 32\) there and"):
        validate(compose_config([*FAST, f"init_from={tmp_path / 'hf'}"]))
    with pytest.raises(ValueError, match=r"init_from=.* is neither a HuggingFace folder .* nor a sharded checkpoint"):
        validate(compose_config([*FAST, f"init_from={tmp_path}"]))


def test_an_hf_model_starts_from_its_folder_under_a_pipeline(tmp_path: Path) -> None:
    from lightning_dist.config.build import build_module

    cfg = compose_config(HF)
    module = build_module(cfg)
    module.configure_model()  # the HF model is built here, as the built-in GPT is
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.05 * torch.randn_like(param))  # not what the run would initialize
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "hf.ckpt")
    export_main([str(tmp_path / "hf.ckpt"), str(tmp_path / "hf")])
    run = run_app(
        [*HF, "parallelism=pp", "cluster.devices=2", "trainer.max_steps=1",
         "optim.lr=0", "trainer.enable_checkpointing=true", f"init_from={tmp_path / 'hf'}"],
        tmp_path / "run",
    )  # fmt: skip
    export_main([run["checkpoint"], str(tmp_path / "run.pt")])
    for name, tensor in torch.load(tmp_path / "run.pt", weights_only=True).items():
        torch.testing.assert_close(tensor, module.state_dict()[name], rtol=0, atol=0)
