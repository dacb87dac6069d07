"""``checkpoint.save_hf=true``: each published checkpoint holds HuggingFace safetensors (``<checkpoint>/hf``), written
by every rank's slices and consolidated, that transformers loads: the same tensors ``lightning-dist-export`` writes from
that checkpoint, under a pipeline (each rank its own stage's tensors) and under tensor parallelism (each rank its
shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FAST, run_app
from safetensors.torch import load_file

from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.config.validate import validate

transformers = pytest.importorskip("transformers")

SAVING = ["trainer.max_steps=2", "trainer.enable_checkpointing=true", "checkpoint.save_hf=true"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check(run: dict, tmp_path: Path) -> None:
    checkpoint = Path(run["checkpoint"])
    hf = checkpoint / "hf"
    assert (hf / "config.json").is_file() and not (hf / "sharded").exists()
    export_main([str(checkpoint), str(tmp_path / "export")])
    written, exported = _weights(hf), _weights(tmp_path / "export")
    assert written.keys() == exported.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0, msg=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 256, (1, 8))
    assert model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3).shape == (1, 11)


def test_the_built_in_gpt_under_a_pipeline_writes_a_folder_transformers_loads(tmp_path: Path) -> None:
    run = run_app([*FAST, *SAVING, "parallelism=pp", "cluster.devices=2"], tmp_path / "run")
    _check(run, tmp_path)


def test_a_huggingface_model_under_tensor_parallelism_writes_a_folder_transformers_loads(tmp_path: Path) -> None:
    common = [o for o in FAST if not o.startswith("model.")]
    run = run_app([*common, *SAVING, "model=hf", "model.config=tiny_llama", "parallelism=tp", "cluster.devices=2"],
                  tmp_path / "run")  # fmt: skip
    _check(run, tmp_path)


def test_an_hf_moe_family_with_its_experts_split_over_ep_writes_a_folder_transformers_loads(tmp_path: Path) -> None:
    """Mixtral's stacked experts, each rank holding half of them (ep2), written under transformers' own names."""
    from support.hf_tiny import tiny_config

    tiny_config("mixtral").save_pretrained(tmp_path / "config")
    common = [o for o in FAST if not o.startswith("model.")]
    run = run_app([*common, *SAVING, "model=hf", f"model.config={tmp_path / 'config'}", "parallelism=ep",
                   "cluster.devices=2"], tmp_path / "run")  # fmt: skip
    _check(run, tmp_path)


def test_a_model_without_huggingface_names_is_refused_before_launch() -> None:
    from helpers import compose_config

    with pytest.raises(ValueError, match=r"^checkpoint.save_hf=true with model.arch=gpt2: its HuggingFace weights"):
        validate(compose_config([*FAST, "checkpoint.save_hf=true", "model.arch=gpt2"]))
    # Lightning's DDP saves one file per checkpoint: no folder for hf/ (it failed at the first save: NotADirectoryError)
    with pytest.raises(ValueError, match=r"^checkpoint.save_hf=true with parallelism=ddp: .* use parallelism=fsdp"):
        validate(compose_config([*FAST, "checkpoint.save_hf=true", "parallelism=ddp"]))


def test_a_model_larger_than_a_shard_is_written_in_files_with_their_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process without a process group, weights in several files that transformers reads through the index."""
    from lightning_dist.checkpoint import hf_save
    from lightning_dist.models.gpt import GPTConfig
    from lightning_dist.models.module import GPTModule
    from lightning_dist.models.optim import OptimConfig

    module = GPTModule(GPTConfig(n_kv_heads=2), OptimConfig(), 10)
    module.configure_model()
    monkeypatch.setattr(hf_save, "MAX_SHARD_BYTES", 100_000)
    folder = hf_save.save_hf(module, tmp_path / "hf", dict(module.hparams))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (folder / "model.safetensors").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, module(tokens), rtol=1e-5, atol=1e-5)
