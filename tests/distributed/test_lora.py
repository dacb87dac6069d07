"""LoRA (model.lora, through peft) under every layout: the one-process curve and adapters, the base frozen and without
optimizer state, checkpoints that reshard the adapters, and exports that peft and transformers load.

A pretrained tiny Llama folder (random weights, saved here) is fine-tuned with rank-4 adapters on every linear layer
of its decoder: under fsdp2, tp2 (the adapters sharded by their base layer's style: A replicated / B colwise for a
colwise layer, A rowwise / B replicated for a rowwise one), pp2 and cp2 the losses and the trained adapters are one
process's. The built-in GPT under tp2 adds sequence parallelism (a rowwise layer's output reduce-scattered onto the
sequence: its B marked sequence-sharded, its gradient summed over tp).
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
from lightning_dist.checkpoint.folder import EXPORT_MARKER

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 4
LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
HF_COMMON = [o for o in FAST if not o.startswith("model.")] + [
    "model=hf",
    *LORA,
    f"trainer.max_steps={STEPS}",
    "trainer.enable_checkpointing=true",
    "checkpoint.every_n_steps=2",
    "checkpoint.save_hf=true",  # each checkpoint's hf/: the peft adapter folder
]
LAYOUTS = {
    "one": ["parallelism=fsdp", "cluster.devices=1"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    # fsdp2 continues tp2's step-2 checkpoint (resharded adapters), with the chunked loss (as the 8B recipe)
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2", "parallelism.loss_chunks=2"],
    "pp2": ["parallelism=pp", "cluster.devices=2"],
    "cp2": ["parallelism=fsdp", "cluster.devices=2", "parallelism.dp_shard=1", "parallelism.cp=2"],
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "tiny-llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.1)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("runs")
    common = [*HF_COMMON, f"model.pretrained={pretrained}"]
    done: dict[str, dict] = {}
    for name, layout in LAYOUTS.items():
        resumed = [f"ckpt_path={_checkpoint(done['tp2'], 2).path}"] if name == "fsdp2" else []
        done[name] = run_app([*common, *layout, *resumed], out / name)
    return done


def _checkpoint(run: dict, step: int = STEPS) -> Checkpoint:
    return Checkpoint(Path(run["checkpoint"]).parent / f"step-{step:08d}")


def test_every_layout_trains_the_one_process_adapters(runs: dict[str, dict], pretrained: Path) -> None:
    one = _checkpoint(runs["one"])
    adapters = [name for name in one.names if ".lora_" in name]
    assert len(adapters) == 2 * 7 * LLAMA["num_hidden_layers"]  # A and B of q, k, v, o, gate, up, down per layer
    trained = one.read(adapters)
    assert all(trained[name].abs().max() > 0 for name in adapters if ".lora_B." in name)  # B starts at zero
    for name in LAYOUTS:
        steps = slice(2, None) if name == "fsdp2" else slice(None)  # from tp2's step 2: a checkpoint resharded
        np.testing.assert_allclose(losses(runs[name]), losses(runs["one"])[steps], rtol=1e-5, err_msg=name)
        assert len(losses(runs[name])) == len(losses(runs["one"])[steps]) > 0
        theirs = _checkpoint(runs[name]).read(adapters)
        for key in adapters:
            torch.testing.assert_close(theirs[key], trained[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
    # The base is frozen: every weight is the pretrained one, bit for bit, after the steps.
    saved = load_file(pretrained / "model.safetensors")
    base = [name for name in one.names if ".lora_" not in name]
    for name, tensor in one.read(base).items():
        own = name.removeprefix("model.").replace(".base_layer", "")
        torch.testing.assert_close(tensor, saved[own], rtol=0, atol=0)


def test_the_optimizer_holds_state_for_the_adapters_only(runs: dict[str, dict]) -> None:
    import torch.distributed.checkpoint as dcp

    for name in ("one", "tp2"):
        keys = dcp.FileSystemReader(str(_checkpoint(runs[name]).path)).read_metadata().state_dict_metadata
        states = [key for key in keys if key.startswith("optimizer_0.state.")]
        assert states and all(".lora_A." in key or ".lora_B." in key for key in states), name


def test_the_adapter_export_loads_with_peft_and_the_merged_export_with_transformers(
    runs: dict[str, dict], pretrained: Path, tmp_path: Path
) -> None:
    run_dir = str(Path(runs["fsdp2"]["checkpoint"]).parents[1])
    export_main([run_dir, str(tmp_path / "adapter")])
    export_main([run_dir, str(tmp_path / "merged"), "--merge"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(pretrained)
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapters only: small

    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        after = merged(ids).logits
    assert (adapted - before).abs().max() > 1e-4  # the trained adapters change the model
    torch.testing.assert_close(adapted, after, rtol=1e-4, atol=1e-5)
    # checkpoint.save_hf wrote the same adapter folder during training (every rank's slices, consolidated).
    during = _checkpoint(runs["fsdp2"]).path / "hf"
    assert set(json.loads((during / "adapter_config.json").read_text())["target_modules"]) == set(
        config["target_modules"]
    )
    for name, tensor in load_file(tmp_path / "adapter" / "adapter_model.safetensors").items():
        torch.testing.assert_close(load_file(during / "adapter_model.safetensors")[name], tensor, rtol=0, atol=0)
    with torch.no_grad():
        fresh = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
        again = peft.PeftModel.from_pretrained(fresh, during).eval()(ids).logits
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)
    trained = _checkpoint(runs["fsdp2"]).read(["model.model.layers.0.self_attn.q_proj.lora_A.default.weight"])
    peft_state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    torch.testing.assert_close(
        peft_state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        trained["model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
        rtol=0,
        atol=0,
    )


def test_the_built_in_gpt_under_tp2_with_sequence_parallelism_matches_one_process(tmp_path: Path) -> None:
    common = [*FAST, *LORA, f"trainer.max_steps={STEPS}", "optim.lr=1e-3"]
    one = run_app([*common, *LAYOUTS["one"]], tmp_path / "one")
    tp2 = run_app([*common, *LAYOUTS["tp2"], "parallelism.tensor.sequence_parallel=true"], tmp_path / "tp2")
    np.testing.assert_allclose(losses(tp2), losses(one), rtol=1e-5)
    assert losses(one)[-1] < losses(one)[0]


def test_the_adapter_is_pushed_to_the_hub_with_a_model_card_from_the_run_s_report(
    runs: dict[str, dict], pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from hub_standin import HubStandIn

    run_dir = Path(runs["fsdp2"]["checkpoint"]).parents[1]
    report = json.loads((run_dir / "report.json").read_text())
    with HubStandIn() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_write_token")
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        export_main([str(run_dir), str(tmp_path / "adapter"), "--push-to-hub", "me/tiny-adapter", "--private"])
    assert hub.uploads[0] == {"create": "me/tiny-adapter", "private": True}
    files = hub.uploads[1]["files"]
    assert (
        set(files)
        == {p.name for p in (tmp_path / "adapter").iterdir()} - {EXPORT_MARKER}  # the export's own mark stays home
        >= {"adapter_model.safetensors", "README.md"}
    )
    assert files["adapter_model.safetensors"] == (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert {r["authorization"] for r in hub.requests} == {"Bearer hf_write_token"}
    card = files["README.md"].decode()
    assert "library_name: peft" in card and f"base_model: {pretrained.name}" in card
    assert f"| tokens seen | {report['steps'] * report['tokens_per_step']:,} |" in card
    assert "| LoRA | rank 4, alpha 8" in card and f"| layout | {report['layout']} |" in card
    assert "| trained on | 2 x CPU |" in card and "H100" not in card  # what ran, not the planner's hardware
    for record in report["history"]:  # the loss curve, every step of this short run
        assert f"| {int(record['step'])} | {record['train/loss']:.4f} |" in card


def test_lora_under_bf16_true_keeps_float32_adapters_on_the_frozen_bf16_base(pretrained: Path, tmp_path: Path) -> None:
    """cluster.precision=bf16-true: the base in bf16, frozen; the adapters float32 (peft's own default), so AdamW's
    updates at a LoRA learning rate are not rounded away (bf16 adapters at lr 2e-4: 62% of A's entries never moved from
    step 2 to 4); fsdp2 (bf16 base and float32 adapters in one FSDP unit) gives one process's losses and adapters."""
    bf16 = ["cluster.precision=bf16-true", "optim.lr=2e-4", "optim.warmup_steps=0"]
    common = [
        *(o for o in HF_COMMON if not o.startswith("checkpoint.save_hf")),
        f"model.pretrained={pretrained}",
        *bf16,
    ]
    one = run_app([*common, *LAYOUTS["one"]], tmp_path / "one")
    fsdp2 = run_app([*common, *LAYOUTS["fsdp2"]], tmp_path / "fsdp2")
    np.testing.assert_allclose(losses(fsdp2), losses(one), rtol=1e-3)  # bf16 matmuls: one rounding is 3.9e-3
    assert len(losses(one)) == STEPS
    names = _checkpoint(one).names
    adapters, base = [n for n in names if ".lora_" in n], [n for n in names if ".lora_" not in n]
    trained, before = _checkpoint(one).read(adapters), _checkpoint(one, 2).read(adapters)
    assert {t.dtype for t in trained.values()} == {torch.float32}
    for name, tensor in _checkpoint(fsdp2).read(adapters).items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, trained[name], rtol=1e-3, atol=1e-5, msg=name)
    for name in adapters:  # every entry of every adapter moved from step 2 to step 4
        assert (trained[name] != before[name]).all(), name
    saved = load_file(pretrained / "model.safetensors")
    for name, tensor in _checkpoint(fsdp2).read(base).items():  # frozen: the pretrained weights in bf16
        own = name.removeprefix("model.").replace(".base_layer", "")
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, saved[own].to(torch.bfloat16), rtol=0, atol=0)
