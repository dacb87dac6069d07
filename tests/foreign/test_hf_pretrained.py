"""``model=hf model.pretrained=<folder or hub id>``: a pretrained HuggingFace model built on the meta device, each rank
reading only its slices of the safetensors, trained under every layout and exported back with its tokenizer.

Nothing is downloaded: a tiny Llama with random weights is saved here as a HuggingFace folder (safetensors, a
tokenizer trained offline, a generation config), and a hub id is looked up in a cache laid out here.
"""

from __future__ import annotations

import inspect
import resource
import shutil
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import FAST, compose_config, losses, make_tiny_tokenizer, run_app
from safetensors.torch import load_file

from lightning_dist.checkpoint.export import Checkpoint
from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.config.build import build_module
from lightning_dist.config.validate import validate
from lightning_dist.data import TokenDataModule
from lightning_dist.models.hf import HFCausalLM, causal_lm_loss, split_causal_batch
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.pipeline import prune_model
from lightning_dist.run.launch import launch
from lightning_dist.telemetry.throughput import resident_memory_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 320  # the tokenizer's 300 tokens fit; the synthetic data's 256 too
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
#: FAST without the built-in GPT's fields; 4 steps.
RUN = [o for o in FAST if not o.startswith("model.")] + ["model=hf", "trainer.max_steps=4"]
LAYOUTS = {
    "one": ["parallelism=fsdp", "cluster.devices=1"],
    "fsdp2": ["parallelism=fsdp", "cluster.devices=2", "trainer.enable_checkpointing=true"],
    "tp2": ["parallelism=tp", "cluster.devices=2"],
    "pp2": ["parallelism=pp", "cluster.devices=2"],
}
MB = 2**20


def save_hf_folder(folder: Path, config: dict, seed: int = 0, **save: object) -> Path:
    """A Llama with random weights (std 0.1: far from what the run would draw) saved as a HuggingFace folder, with a
    tokenizer and a generation config."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, initializer_range=0.1))
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # transformers 4; 5 always is
        save["safe_serialization"] = True
    model.save_pretrained(folder, **save)
    make_tiny_tokenizer(folder, ["the quick brown fox jumps over the lazy dog", "hello world"] * 20, vocab_size=300)
    transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(tmp_path_factory.mktemp("pretrained") / "tiny-llama", TINY)


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("runs")
    return {
        name: run_app([*RUN, f"model.pretrained={pretrained}", *extra], out / name) for name, extra in LAYOUTS.items()
    }


def test_every_layout_starts_from_the_pretrained_weights_and_matches_one_process(runs, pretrained: Path) -> None:
    # The first step's loss is the pretrained model's own loss on that batch: the weights were read (a run from
    # its own initialization, or from zeros, starts elsewhere).
    valid = validate(compose_config([*RUN, f"model.pretrained={pretrained}", *LAYOUTS["one"]]))
    data = TokenDataModule(valid.cfg.data, seed=valid.cfg.seed)
    data.setup()
    inputs, targets = split_causal_batch(next(iter(data.train_dataloader())))
    reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
    with torch.no_grad():
        own_loss = float(causal_lm_loss(reference(input_ids=inputs).logits, targets))
    one = losses(runs["one"])
    assert len(one) == 4
    assert one[0] == pytest.approx(own_loss, rel=1e-5)
    assert abs(own_loss - np.log(VOCAB)) > 0.05  # not a model that predicts the uniform distribution
    for name in ("fsdp2", "tp2", "pp2"):
        np.testing.assert_allclose(losses(runs[name]), one, rtol=1e-5, err_msg=name)


def test_the_checkpoint_exports_with_the_tokenizer_and_generates(runs, pretrained: Path, tmp_path: Path) -> None:
    checkpoint = Checkpoint(Path(runs["fsdp2"]["checkpoint"]))
    assert checkpoint.hyper_parameters["hf_source"] == str(pretrained.resolve())
    out = tmp_path / "export"
    export_main([runs["fsdp2"]["checkpoint"], str(out)])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (pretrained / name).is_file():
            assert (out / name).read_bytes() == (pretrained / name).read_bytes(), name
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # The exported weights are the trained ones (not the pretrained ones).
    trained = checkpoint.read(checkpoint.names)
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported.keys() == {name.removeprefix("model.") for name in trained}
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[name.removeprefix("model.")], tensor, rtol=0, atol=0)
    before = load_file(pretrained / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], before)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0)
    prompt = tokenizer("the quick brown fox", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 5)
    assert isinstance(tokenizer.decode(generated[0]), str)
    assert model.generation_config.eos_token_id == 0  # the source folder's generation config


def test_the_built_in_gpt_started_from_a_hf_folder_exports_its_tokenizer(pretrained: Path, tmp_path: Path) -> None:
    cfg = compose_config([*FAST, f"init_from={pretrained}"])  # built, not validated: no shape check needed
    module = build_module(cfg)
    assert module.hparams["hf_source"] == str(pretrained.resolve())
    module.configure_model()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "gpt.ckpt")
    export_main([str(tmp_path / "gpt.ckpt"), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    # Without a HuggingFace source nothing is copied.
    module = build_module(compose_config(FAST))
    assert "hf_source" not in module.hparams


def test_without_pretrained_weights_every_layout_draws_the_one_process_values(tmp_path: Path) -> None:
    """Random initialization at real size: each rank draws only its part, by parameter name (a tied head too)."""
    folder = tmp_path / "config"
    transformers.LlamaConfig(**TINY, tie_word_embeddings=True).save_pretrained(folder)
    run = [*RUN, f"model.config={folder}", "trainer.max_steps=3"]
    one = losses(run_app([*run, "parallelism=ddp", "cluster.devices=1"], tmp_path / "one"))  # built in configure_model
    for name in ("fsdp2", "pp2"):
        layout = [o for o in LAYOUTS[name] if "checkpointing" not in o]
        np.testing.assert_allclose(losses(run_app([*run, *layout], tmp_path / name)), one, rtol=1e-5, err_msg=name)


# ------------------------------------------------------------------------------------------------ hub ids, errors
def _lay_out_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder`` as huggingface_hub stores a downloaded snapshot: blobs, a snapshot of links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_resolves_to_the_local_cache_only(env: str, pretrained: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "hub"
    snapshot = _lay_out_hub_cache(cache, "tiny-org/tiny-llama", pretrained)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_config([*RUN, "model.pretrained=tiny-org/tiny-llama", *LAYOUTS["tp2"]], tmp_path / "run")
    valid = validate(cfg)
    assert valid.cfg.model.pretrained == valid.cfg.init_from == str(snapshot.resolve())
    assert cfg.model.pretrained == "tiny-org/tiny-llama"  # the input is not changed
    assert build_module(valid.cfg).hparams["hf_config"]["hidden_size"] == TINY["hidden_size"]

    missing = compose_config([*RUN, "model.pretrained=tiny-org/not-downloaded"], tmp_path / "run")
    message = r"^model.pretrained=tiny-org/not-downloaded is neither a local folder nor in the HuggingFace cache "
    with pytest.raises(ValueError, match=message + r".*HF_HUB_OFFLINE is set.*hf download") as err:
        validate(missing)
    assert "\n" not in str(err.value)


def test_bad_pretrained_settings_are_one_line_before_launch(pretrained: Path, tmp_path: Path) -> None:
    other = save_hf_folder(tmp_path / "other", TINY, seed=1)
    cases = [
        ([f"model.pretrained={pretrained}", f"init_from={other}"],
         r"^init_from=.*other and model.pretrained=.*tiny-llama name different weights; set only"),
        ([f"model.pretrained={tmp_path / 'empty'}"], r"^model.pretrained=.*empty .* holds no HuggingFace model"),
        ([f"model.pretrained={pretrained}", "model.config=tiny_qwen2"], r"model.embed_tokens.weight has shape"),
    ]  # fmt: skip
    (tmp_path / "empty").mkdir()
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            validate(compose_config([*RUN, *overrides], tmp_path / "run"))
        assert "\n" not in str(err.value)
    # The same folder named twice is one start, and model.config may be left out.
    valid = validate(compose_config([*RUN, f"model.pretrained={pretrained}", f"init_from={pretrained}"], tmp_path))
    assert valid.cfg.init_from == str(pretrained.resolve()) and valid.cfg.model.config is None


# ---------------------------------------------------------------------------------------------- the module itself
def test_the_module_uses_the_runs_optimizer_config(pretrained: Path) -> None:
    cfg = compose_config([*RUN, f"model.pretrained={pretrained}", "optim.lr=0.05", "optim.warmup_steps=2"])
    module = build_module(validate(cfg).cfg)
    assert module.optim_config.lr == 0.05 and module.max_steps == 4 and not module.random_init
    module.configure_model()
    optimizers = module.configure_optimizers()
    decay, no_decay = optimizers["optimizer"].param_groups
    names = {id(p): n for n, p in module.named_parameters()}
    assert decay["weight_decay"] == cfg.optim.weight_decay > 0 and no_decay["weight_decay"] == 0
    assert all(names[id(p)].endswith("proj.weight") or names[id(p)] == "model.lm_head.weight" for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"model.model.embed_tokens.weight", "model.model.norm.weight"}
    scheduler = optimizers["lr_scheduler"]["scheduler"]
    assert optimizers["optimizer"].param_groups[0]["lr"] == pytest.approx(0.05 / 2)  # warmup: step 1 of 2
    assert scheduler.lr_lambdas[0](4) == pytest.approx(cfg.optim.min_lr_ratio)  # the cosine's end at max_steps
    # A library user's module without an optimizer config gets the defaults.
    assert HFCausalLM(transformers.LlamaConfig(**TINY)).optim_config == OptimConfig()


def test_reset_parameters_gives_one_process_values_and_rotary_tables(pretrained: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(pretrained)
    whole = HFCausalLM(config, init_seed=3)
    whole.configure_model()  # outside a mesh strategy: allocated and initialized here
    with torch.device("meta"):
        part = HFCausalLM(config, init_seed=3)
        part.configure_model()
    assert all(p.is_meta for p in part.parameters())
    spec = part.pipeline_spec()  # the last of two pipeline stages: blocks 2 and 3, the norm and the head
    prune_model(spec.model(part), spec, {"2", "3"}, first=False, last=True)
    part.model.to_empty(device="cpu")
    part.reset_parameters()
    assert "model.model.embed_tokens.weight" not in part.state_dict()
    assert len(part.state_dict()) == 1 + 1 + 2 * 9  # head, norm, two blocks
    for name, tensor in part.state_dict().items():
        torch.testing.assert_close(tensor, whole.state_dict()[name], rtol=0, atol=0)
    fresh = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    torch.testing.assert_close(part.model.model.rotary_emb.inv_freq, fresh, rtol=0, atol=0)
    std = float(whole.model.model.layers[0].mlp.up_proj.weight.std())
    assert std == pytest.approx(config.initializer_range, rel=0.05)  # transformers' own scale


# ------------------------------------------------------------------------------------------------------- memory
#: ~236 MiB of float32 parameters, saved in ~50 MB safetensors files as real checkpoints are (a reading rank maps
#: one file at a time: the pages it touched count in its resident memory until that file is closed).
BIG = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
       "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip
#: What a rank holds beyond its half of the parameters at the first step's start: its share of the one safetensors
#: file it reads at a time (<= 25 MB here), one slice being copied, FSDP2 / DTensor state and allocator slack.
#: Measured on 2026-11-24 (236 MiB model): an fsdp2 rank grows by 151-154 MiB (half + 33-36 MiB), one process by 282
#: MiB; built for real on every rank (no reset_parameters, so no meta device) an fsdp2 rank grows by the whole model.
CONSTANT = 64 * MB


class _PeakMemory(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = resident_memory_bytes()  # the model is not built yet (configure_model comes after setup)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # weights read by now
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
        self.result = {
            "growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.before,
            "local_bytes": sum(t.numel() * t.element_size() for t in local),
            "model_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "checksum": float(sum(t.detach().double().sum() for t in local)),
        }


def _fit(cfg) -> dict:
    import ctypes

    from lightning_dist.run.fit import fit

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: RSS follows what is alive (test_meta_init.py)
    probe = _PeakMemory()
    fit(cfg, callbacks=(probe,))
    return probe.result


def test_an_fsdp2_rank_builds_on_meta_and_holds_only_its_half(tmp_path: Path) -> None:
    folder = save_hf_folder(tmp_path / "big", BIG, max_shard_size="50MB")
    assert len(list(folder.glob("*.safetensors"))) > 3
    overrides = [*RUN, f"model.pretrained={folder}", "trainer.max_steps=1", "data.seq_len=16", "data.vocab_size=256"]
    ranks = launch(_fit, 2, compose_config([*overrides, "parallelism=fsdp", "cluster.devices=2"], tmp_path / "run"))
    total = ranks[0]["model_bytes"]
    assert total > 230 * MB
    assert sum(rank["local_bytes"] for rank in ranks) == total  # sharded: each parameter once over the two ranks
    expected = sum(float(t.double().sum()) for f in folder.glob("*.safetensors") for t in load_file(f).values())
    assert sum(rank["checksum"] for rank in ranks) == pytest.approx(expected, rel=1e-6)  # the pretrained values
    for rank in ranks:
        assert rank["local_bytes"] == pytest.approx(total / 2, rel=0.01)
        assert rank["growth"] < total / 2 + CONSTANT, (rank["growth"] / MB, total / MB)
