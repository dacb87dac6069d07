"""QLoRA (model.lora.quantize=nf4): LoRA adapters trained on a pretrained base stored in torchao's NF4, under one
process and fsdp2, checkpointed and resumed exactly, exported as a peft adapter folder.

A pretrained tiny Llama folder (random weights, every linear weight a multiple of NF4's 64 x 256 values) is
fine-tuned with rank-4 adapters on every linear layer of its decoder. The reference is plain LoRA on a copy of the
folder whose linear weights are ``to_nf4(weight)`` dequantized: QLoRA computes with exactly that base, so its losses
and adapters are the reference's. Under fsdp2 the 4-bit base stays whole on every rank (quantized from each whole
weight, as one process does) while the adapters, embedding, norms and head are sharded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, losses, run_app
from safetensors.torch import load_file

from lightning_dist.checkpoint.export import Checkpoint
from lightning_dist.checkpoint.export import main as export_main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
torchao = pytest.importorskip("torchao.quantization")

STEPS = 4
LLAMA = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMMON = [o for o in FAST if not o.startswith("model.")] + [
    "model=hf",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    f"trainer.max_steps={STEPS}",
    "trainer.enable_checkpointing=true",
    "checkpoint.every_n_steps=2",
]
QLORA = [*COMMON, "model.lora.quantize=nf4"]
ONE = ["parallelism=fsdp", "cluster.devices=1"]
FSDP2 = ["parallelism=fsdp", "cluster.devices=2"]


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEARS


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The pretrained folder, and the reference's copy holding NF4's dequantized values in its linear weights."""
    root = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.1))
    model.save_pretrained(root / "pretrained")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_linear(name):
                param.copy_(torchao.to_nf4(param.detach()).get_original_weight())
    model.save_pretrained(root / "dequantized")
    return {"pretrained": root / "pretrained", "dequantized": root / "dequantized"}


@pytest.fixture(scope="module")
def runs(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("runs")
    pretrained = f"model.pretrained={folders['pretrained']}"
    done = {
        "one": run_app([*QLORA, pretrained, *ONE, "checkpoint.save_hf=true"], out / "one"),
        "reference": run_app([*COMMON, f"model.pretrained={folders['dequantized']}", *ONE], out / "reference"),
        "fsdp2": run_app([*QLORA, pretrained, *FSDP2], out / "fsdp2"),
    }
    # One process continues fsdp2's step-2 checkpoint: its NF4 base is read back as saved.
    resume = f"ckpt_path={_checkpoint(done['fsdp2'], 2).path}"
    done["resumed"] = run_app([*QLORA, pretrained, *ONE, resume], out / "resumed")
    return done


def _checkpoint(run: dict, step: int = STEPS) -> Checkpoint:
    return Checkpoint(Path(run["checkpoint"]).parent / f"step-{step:08d}")


def _adapters(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return ckpt.read([name for name in ckpt.names if ".lora_" in name])


def test_qlora_trains_adapters_on_the_nf4_of_the_pretrained_base(runs: dict[str, dict], folders: dict) -> None:
    one = _checkpoint(runs["one"])
    saved = load_file(folders["pretrained"] / "model.safetensors")
    own = {name.removeprefix("model.").replace(".base_layer", ""): name for name in one.names if ".lora_" not in name}
    assert sorted(one.nf4_names) == sorted(own[key] for key in own if _is_linear(key))
    assert len(one.nf4_names) == len(LINEARS) * LLAMA["num_hidden_layers"]
    base = one.read(list(own.values()))
    for key, name in own.items():  # the base after training: the NF4 of the pretrained weights, the rest as read
        expected = torchao.to_nf4(saved[key]).get_original_weight() if _is_linear(key) else saved[key]
        torch.testing.assert_close(base[name], expected, rtol=0, atol=0, msg=name)
    # QLoRA computes with the dequantized base: plain LoRA on a folder holding it gives its losses and adapters.
    np.testing.assert_allclose(losses(runs["one"]), losses(runs["reference"]), rtol=1e-5)
    assert len(losses(runs["one"])) == STEPS and losses(runs["one"])[-1] < losses(runs["one"])[0]
    theirs = _adapters(_checkpoint(runs["reference"]))
    for name, tensor in _adapters(one).items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=1e-6, msg=name)
        assert ".lora_A." in name or tensor.abs().max() > 0  # B starts at zero: trained


def test_fsdp2_and_a_resume_from_its_checkpoint_give_the_one_process_run(runs: dict[str, dict]) -> None:
    np.testing.assert_allclose(losses(runs["fsdp2"]), losses(runs["one"]), rtol=1e-5)
    np.testing.assert_allclose(losses(runs["resumed"]), losses(runs["one"])[2:], rtol=1e-5)
    assert len(losses(runs["resumed"])) == STEPS - 2
    one = _checkpoint(runs["one"])
    for name in ("fsdp2", "resumed"):
        ckpt = _checkpoint(runs[name])
        assert sorted(ckpt.nf4_names) == sorted(one.nf4_names), name
        for key, tensor in ckpt.read(ckpt.nf4_names).items():  # the same 4-bit base, bit for bit
            torch.testing.assert_close(tensor, one.read([key])[key], rtol=0, atol=0, msg=f"{name}: {key}")
        ours = _adapters(one)
        for key, tensor in _adapters(ckpt).items():
            torch.testing.assert_close(tensor, ours[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_the_optimizer_holds_state_for_the_adapters_only(runs: dict[str, dict]) -> None:
    import torch.distributed.checkpoint as dcp

    for name in ("one", "fsdp2"):
        keys = dcp.FileSystemReader(str(_checkpoint(runs[name]).path)).read_metadata().state_dict_metadata
        states = [key for key in keys if key.startswith("optimizer_0.state.")]
        assert states and all(".lora_A." in key or ".lora_B." in key for key in states), name


def test_the_adapter_loads_with_peft_on_the_unquantized_base_and_merges_into_the_dequantized_one(
    runs: dict[str, dict], folders: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = str(Path(runs["one"]["checkpoint"]).parents[1])
    export_main([run_dir, str(tmp_path / "adapter")])
    export_main([run_dir, str(tmp_path / "merged"), "--merge"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(folders["pretrained"])
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    during = load_file(_checkpoint(runs["one"]).path / "hf" / "adapter_model.safetensors")  # checkpoint.save_hf
    assert exported.keys() == during.keys() and all(torch.equal(exported[k], during[k]) for k in exported)

    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))

    def logits(folder: Path, adapter: Path | None = None) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(model, adapter) if adapter is not None else model
        with torch.no_grad():
            return model.eval()(ids).logits

    # The usual QLoRA hand-off: the adapter on the full-precision base it was trained over (in 4 bits).
    adapted = logits(folders["pretrained"], tmp_path / "adapter")
    assert (adapted - logits(folders["pretrained"])).abs().max() > 1e-4  # the trained adapters change the model
    # --merge folds the adapters into the base the run computed with (NF4, dequantized).
    torch.testing.assert_close(
        logits(tmp_path / "merged"), logits(folders["dequantized"], tmp_path / "adapter"), rtol=1e-4, atol=1e-5
    )


def test_a_qlora_checkpoint_starts_a_new_run_but_is_continued_by_qlora_only(
    runs: dict[str, dict], folders: dict[str, Path]
) -> None:
    from helpers import compose_config

    from lightning_dist.checkpoint.weights import load_weights
    from lightning_dist.config.validate import validate
    from lightning_dist.models.hf import HFCausalLM
    from lightning_dist.models.lora_config import LoraConfig

    one = _checkpoint(runs["one"])
    # init_from: a plain LoRA module starts from what the QLoRA run computed with (its NF4 base, dequantized).
    module = HFCausalLM(transformers.AutoConfig.from_pretrained(folders["pretrained"]), lora=LoraConfig(4, 8.0))
    module.configure_model()
    load_weights(one.path, module)
    saved = one.read(one.names)
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    # ckpt_path: continuing it without model.lora.quantize is refused in one line, before launch.
    plain = [*COMMON, f"model.pretrained={folders['pretrained']}", *ONE, f"ckpt_path={one.path}"]
    with pytest.raises(ValueError, match=r"^ckpt_path=\S+ holds a QLoRA run's 4-bit base") as err:
        validate(compose_config(plain))
    assert "\n" not in str(err.value)
    validate(compose_config([*plain, "model.lora.quantize=nf4"]))


def test_context_parallelism_gives_the_one_process_run(runs: dict[str, dict], folders: dict, tmp_path: Path) -> None:
    cp2 = [*FSDP2, "parallelism.dp_shard=1", "parallelism.cp=2", f"model.pretrained={folders['pretrained']}"]
    np.testing.assert_allclose(losses(run_app([*QLORA, *cp2], tmp_path)), losses(runs["one"]), rtol=1e-5)
