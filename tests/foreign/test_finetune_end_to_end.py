"""Fine-tuning end to end through the app: a pretrained HuggingFace Llama folder, an instruction file (the loss on the
responses only), every layout on the one-process curve, an exact mid-epoch resume, and an export that transformers
loads and generates with.

Masked targets make the samples of a batch hold different numbers of loss tokens, so a per-micro-batch token mean
would change with how the global batch is split (ranks, accumulation, pipeline microbatches); the loss is the token
mean over each global batch instead (``lightning_dist/data/token_norm.py``, ``lightning_dist/models/loss.py``), which
this file checks at rtol 1e-5 against one process, the validation loss too. Nothing is downloaded: the model's weights
are random, its tokenizer is trained here.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, compose_config, losses, make_tiny_tokenizer, run_app, write_instruction_jsonl
from safetensors.torch import load_file

from lightning_dist.checkpoint.export import Checkpoint
from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.config.validate import validate
from lightning_dist.data import TokenDataModule
from lightning_dist.data.packed import IGNORE_INDEX

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

STEPS, GLOBAL_BATCH, VAL_WINDOWS, RECORDS = 8, 8, 16, 120
LLAMA = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
#: FAST without the built-in GPT's and the synthetic data's fields, validation once, over every validation window.
COMMON = [o for o in FAST if not o.startswith(("model.", "data.num_", "trainer.limit_val", "trainer.num_sanity"))] + [
    "model=hf",
    "data=hf",
    "data.format=instruction",
    "data.seq_len=32",
    f"data.global_batch_size={GLOBAL_BATCH}",
    "data.num_proc=1",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=100",
    "trainer.num_sanity_val_steps=0",
]
SAVING = ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=4"]
LAYOUTS = {
    "one": ["parallelism=fsdp", "cluster.devices=1"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "pp2": ["parallelism=pp", "cluster.devices=2"],  # 2 microbatches of 4
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2"],
    "fsdp2_accumulate": ["parallelism=fsdp", "cluster.devices=2", "data.micro_batch_size=1", *SAVING],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A tiny Llama with random weights, a tokenizer trained on the records and a generation config, saved as a
    HuggingFace folder; the instruction file; the run's overrides (the validation split holds VAL_WINDOWS windows)."""
    root = tmp_path_factory.mktemp("finetune")
    records = write_instruction_jsonl(root / "sft.jsonl", RECORDS)
    folder = root / "tiny-llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.1))
    transformers_4 = "safe_serialization" in inspect.signature(model.save_pretrained).parameters  # 5 always is
    model.save_pretrained(folder, **({"safe_serialization": True} if transformers_4 else {}))
    make_tiny_tokenizer(folder, records.read_text().splitlines(), vocab_size=300)
    transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=0).save_pretrained(folder)
    overrides = [*COMMON, f"model.pretrained={folder}", f"data.path={records}", f"data.cache_dir={root / 'cache'}"]
    data = _datamodule(overrides)  # tokenizes once, into the cache every run then maps
    windows = len(data.dataset("train")) + len(data.dataset("val"))
    overrides.append(f"data.val_fraction={VAL_WINDOWS / windows}")
    train = len(_datamodule(overrides).dataset("train"))
    assert STEPS < train // GLOBAL_BATCH < 2 * STEPS, f"{train} train windows: resize RECORDS"  # resumed mid-epoch
    return overrides


def _datamodule(overrides: list[str]) -> TokenDataModule:
    cfg = validate(compose_config([*overrides, *LAYOUTS["one"]])).cfg
    data = TokenDataModule(cfg.data, seed=cfg.seed)
    data.setup()
    return data


@pytest.fixture(scope="module")
def runs(setup: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("runs")
    return {name: run_app([*setup, *layout], out / name) for name, layout in LAYOUTS.items()}


def test_every_layout_trains_on_the_one_process_curve(setup: list[str], runs: dict[str, dict]) -> None:
    # The data is what the test is about: loss on the responses only, a different number of loss tokens per window.
    data = _datamodule(setup)
    _, targets, norm = next(iter(data.train_dataloader()))
    valid = (targets != IGNORE_INDEX).sum(dim=1)
    assert 0 < valid.min() < valid.max() < targets.shape[1]
    assert norm.tolist() == [[GLOBAL_BATCH, int(valid.sum())]] * GLOBAL_BATCH  # one process: the batch is global
    one = losses(runs["one"])
    assert len(one) == STEPS and runs["one"]["val_loss"] is not None
    for name in LAYOUTS:
        np.testing.assert_allclose(losses(runs[name]), one, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(runs[name]["val_loss"], runs["one"]["val_loss"], rtol=1e-5, err_msg=name)


def test_the_built_in_gpt_on_the_same_data_matches_under_tensor_and_loss_parallelism(
    setup: list[str], tmp_path: Path
) -> None:
    """The built-in GPT's loss parallelism computes the loss on vocabulary-sharded DTensor logits."""
    folder = next(o for o in setup if o.startswith("model.pretrained=")).partition("=")[2]
    gpt = [o for o in setup if not o.startswith(("model.", "model="))]
    gpt += [f"data.tokenizer={folder}", "model.vocab_size=320", "model.max_seq_len=64"]
    one = run_app([*gpt, *LAYOUTS["one"]], tmp_path / "one")
    tp2 = run_app([*gpt, *LAYOUTS["tp2"], "parallelism.tensor.loss_parallel=true"], tmp_path / "tp2")
    np.testing.assert_allclose(losses(tp2), losses(one), rtol=1e-5)
    np.testing.assert_allclose(tp2["val_loss"], one["val_loss"], rtol=1e-5)


def test_a_run_resumed_mid_epoch_continues_the_uninterrupted_curve(
    setup: list[str], runs: dict[str, dict], tmp_path: Path
) -> None:
    written = runs["fsdp2_accumulate"]
    step_4 = Path(written["checkpoint"]).parent / "step-00000004"
    resumed = run_app([*setup, *LAYOUTS["fsdp2_accumulate"], f"ckpt_path={step_4}"], tmp_path)
    np.testing.assert_allclose(losses(resumed), losses(written)[4:], rtol=1e-5)
    np.testing.assert_allclose(resumed["val_loss"], written["val_loss"], rtol=1e-5)


def test_the_fine_tuned_model_exports_to_a_folder_transformers_loads_and_generates_with(
    setup: list[str], runs: dict[str, dict], tmp_path: Path
) -> None:
    checkpoint_path = runs["fsdp2_accumulate"]["checkpoint"]
    out = tmp_path / "export"
    export_main([checkpoint_path, str(out)])
    checkpoint = Checkpoint(Path(checkpoint_path))
    trained = checkpoint.read(checkpoint.names)
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported.keys() == {name.removeprefix("model.") for name in trained}
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[name.removeprefix("model.")], tensor, rtol=0, atol=0)
    pretrained = Path(next(o for o in setup if o.startswith("model.pretrained=")).partition("=")[2])
    before = load_file(pretrained / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], before)  # trained, not the pretrained

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0)
    prompt = tokenizer("question 7: what is 7 plus 7?", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 5)
    assert isinstance(tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :]), str)
