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


#: A pretrained tiny Llama whose every linear weight fills NF4's groups of 64 x 256 values (QLoRA can quantize it).
NF4_LLAMA = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(("quantize", "devices"), [(None, 2), ("nf4", 1)], ids=["lora-2-devices", "qlora-1-device"])
def test_lora_and_qlora_on_the_default_layout_write_an_adapter_folder_peft_loads(
    quantize: str | None, devices: int, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """The most common fine-tune, on the default layout (parallelism=ddp, whose Lightning DDP writes each checkpoint
    as one file: no folder for hf/, and QLoRA's 4-bit base read back too early): it runs as the mesh's replication,
    saying so in one line, and each checkpoint's hf/ is the peft adapter lightning-dist-export writes."""
    peft = pytest.importorskip("peft")
    if quantize:
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**NF4_LLAMA, initializer_range=0.1)).save_pretrained(
        tmp_path / "pretrained"
    )
    common = [o for o in FAST if not o.startswith("model.")]
    lora = ["model=hf", f"model.pretrained={tmp_path / 'pretrained'}", "model.lora.rank=4"]
    lora += [f"model.lora.quantize={quantize}"] if quantize else []
    run = run_app([*common, *SAVING, *lora, f"cluster.devices={devices}"], tmp_path / "run")
    assert "note: checkpoint.save_hf=true" in capfd.readouterr().err
    assert run["layout"].startswith("fsdp: ") and f"dp_replicate={devices} dp_shard=1" in run["layout"]
    hf = Path(run["checkpoint"]) / "hf"
    export_main([str(Path(run["checkpoint"])), str(tmp_path / "export")])
    written, exported = _weights(hf), _weights(tmp_path / "export")
    assert written.keys() == exported.keys() and any(".lora_B." in name for name in written)
    for name, tensor in exported.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0, msg=name)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, hf).eval()
    ids = torch.randint(0, 256, (1, 8))
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, min_new_tokens=3).shape == (1, 11)
