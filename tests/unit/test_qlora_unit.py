"""QLoRA's parts without a process group: the frozen base stored in torchao's NF4 under peft's LoRA layers (the
forward computes with the dequantized base, the backward trains the adapters only), the base FSDP2 leaves whole, what
is refused before launch, and the planner's 4-bit base."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import FAST, compose_config
from torch import nn

from lightning_dist.config.validate import validate
from lightning_dist.models.lora import apply_lora, init_lora
from lightning_dist.models.lora_config import NF4_BYTES_PER_PARAM, LoraConfig
from lightning_dist.models.qlora import dequantized, is_nf4, quantize_base

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
nf4 = pytest.importorskip("torchao.quantization")

#: Every linear weight a multiple of NF4's 64 x 256 values (128 x 128, 128 x 256).
LLAMA = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip
QLORA = LoraConfig(rank=4, alpha=8, quantize="nf4")
BLOCKS = "model.layers"


def _adapted_llama() -> nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.1))
    apply_lora(model, QLORA, BLOCKS)
    init_lora(model, seed=3)
    with torch.no_grad():  # B starts at zero: give it values, so the adapters change the output and get gradients
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return model


def test_the_base_is_torchaos_nf4_and_the_lora_layers_compute_with_it_dequantized() -> None:
    model = _adapted_llama()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    # The reference: the same adapters on a plain base holding NF4's dequantized values.
    reference = copy.deepcopy(model)
    quantized = quantize_base(model, BLOCKS)
    assert len(quantized) == 7 * LLAMA["num_hidden_layers"]  # q, k, v, o, gate, up, down of each layer
    for layer in quantized:
        weight = model.get_submodule(layer).weight
        assert is_nf4(weight) and not weight.requires_grad
        own = nf4.to_nf4(before[f"{layer}.weight"])
        assert torch.equal(weight.quantized_data, own.quantized_data)
        assert torch.equal(dequantized(weight), own.get_original_weight())  # torchao's own round trip
        assert not torch.equal(dequantized(weight), before[f"{layer}.weight"])  # 4 bits: not the weight itself
        reference.get_submodule(layer).weight.data.copy_(own.get_original_weight())
    for name, param in model.named_parameters():  # the embedding, head, norms and adapters keep their values
        if not is_nf4(param):
            assert torch.equal(param, before[name]), name
    assert all(".base_layer" in layer for layer in quantized)  # every linear layer is adapted by default

    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, reference)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-8, msg=name)
        else:
            assert param.grad is None, name  # the base (NF4 or not) is frozen
    assert quantize_base(model, BLOCKS) == []  # once only: quantized layers are skipped


def test_quantize_base_refuses_what_nf4_cannot_hold_in_one_line() -> None:
    small = nn.Sequential(nn.Sequential(nn.Linear(32, 32)))
    small.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^model.lora.quantize=nf4: 0.0.weight has 1024 values, not a multiple"):
        quantize_base(small, "0")
    trained = nn.Sequential(nn.Sequential(nn.Linear(128, 128)))
    with pytest.raises(ValueError, match=r"^model.lora.quantize=nf4: 0.0.weight is trained; QLoRA quantizes"):
        quantize_base(trained, "0")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=128, n_layer=1, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match=r"^model.lora.quantize=nf4: transformer.h.0.attn.c_attn is transformers'"):
        quantize_base(gpt2, "transformer.h")


def test_fsdp2_leaves_the_qlora_base_whole_and_shards_the_rest() -> None:
    import lightning.pytorch  # noqa: F401  first: importing Lightning registers our strategies, which import contract

    from lightning_dist.contract import declared_unsharded
    from lightning_dist.models.hf import HFCausalLM

    config = transformers.LlamaConfig(**LLAMA)
    module = HFCausalLM(config, lora=QLORA)
    module.configure_model()
    whole = declared_unsharded(module)
    names = {id(param): name for name, param in module.named_parameters()}
    assert sorted(names[id(p)] for p in whole) == sorted(n for n in names.values() if n.endswith(".base_layer.weight"))
    assert len(whole) == 7 * LLAMA["num_hidden_layers"] and not any(p.requires_grad for p in whole)
    plain = HFCausalLM(config, lora=LoraConfig(rank=4))
    plain.configure_model()
    assert declared_unsharded(plain) == []  # LoRA without quantize: FSDP2 shards the base as before

    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def unsharded_parameters(self) -> list[nn.Parameter]:
            return [self.layer.weight]

    with pytest.raises(ValueError, match=r"^Wrong.unsharded_parameters\(\) names layer.weight, which is trained"):
        declared_unsharded(Wrong())


def test_the_built_in_gpt_quantizes_its_blocks_at_fit_start_and_leaves_them_out_of_fsdp2() -> None:
    import lightning.pytorch  # noqa: F401  first: importing Lightning registers our strategies, which import contract

    from lightning_dist.contract import declared_unsharded
    from lightning_dist.models.gpt import GPTConfig
    from lightning_dist.models.module import GPTModule
    from lightning_dist.models.optim import OptimConfig

    cfg = GPTConfig(d_model=128, n_heads=4, n_kv_heads=4, ffn_hidden=512, vocab_size=256, n_layers=2, lora=QLORA)
    module = GPTModule(cfg, OptimConfig(), 10, init_seed=3)
    module.configure_model()
    ids = {id(p) for p in declared_unsharded(module)}
    before = {name: p.detach().clone() for name, p in module.named_parameters() if id(p) in ids}
    module.on_fit_start()
    assert sorted(n for n, p in module.named_parameters() if is_nf4(p)) == sorted(before)
    assert len(before) == 7 * 2 and all(".base_layer." in name for name in before)
    for name, old in before.items():
        assert torch.equal(dequantized(module.get_parameter(name)), nf4.to_nf4(old).get_original_weight()), name
    assert not is_nf4(module.model.head.weight) and not is_nf4(module.model.tok_emb.weight)


#: The tiny GPT with NF4-sized weights (128 x 128, 128 x 512).
WIDE = ["model.d_model=128", "model.n_kv_heads=4", "model.ffn_hidden=512"]
QGPT = [*FAST, "model.lora.rank=4", "model.lora.quantize=nf4", *WIDE]
HF = [o for o in FAST if not o.startswith("model.")] + ["model=hf", "model.lora.rank=4"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*FAST, "model.lora.quantize=nf4"], r"^model.lora.quantize=nf4 \(QLoRA\) quantizes the frozen base under"),
        ([*FAST, "model.lora.rank=4", "model.lora.quantize=int4"], r"^model.lora.quantize='int4' is unknown"),
        (  # the tiny GPT's 64-wide layers do not fill NF4's groups of 64 x 256 values
            [*FAST, "model.lora.rank=4", "model.lora.quantize=nf4"],
            r"^model.lora.quantize=nf4 \(QLoRA\): the blocks' q_proj weight has 4096 values, not a multiple of 16384",
        ),
        ([*QGPT, "parallelism=tp", "cluster.devices=2"], r"^model.lora.quantize=nf4 \(QLoRA\) under tp=2: tensor"),
        ([*QGPT, "parallelism=pp", "cluster.devices=2"], r"^model.lora.quantize=nf4 \(QLoRA\) under pp=2: not wired"),
        (
            [*HF, "model.config=tiny_gpt2", "model.lora.quantize=nf4"],
            r"^model.lora.quantize=nf4 \(QLoRA\) with a GPT-2",
        ),
    ],
)
def test_qlora_values_that_cannot_run_stop_before_launch_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        validate(compose_config(overrides))
    assert "\n" not in str(err.value)


def test_qlora_runs_under_fsdp_replication_and_context_parallelism() -> None:
    two = ["parallelism=fsdp", "cluster.devices=2"]
    replicated = [*two, "parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
    cp2 = [*two, "parallelism.dp_shard=1", "parallelism.cp=2"]
    for layout in (["parallelism=fsdp", "cluster.devices=1"], two, replicated, cp2):
        validate(compose_config([*QGPT, *layout]))


def test_qlora_on_the_default_layout_runs_as_the_meshs_replication(capfd: pytest.CaptureFixture) -> None:
    """parallelism=ddp (the default): Lightning's DDP reads its one-file checkpoints back before the base is
    quantized, so the run replicates on the mesh (FSDP2, dp_shard=1), with one line saying so."""
    for devices in (1, 2):
        valid = validate(compose_config([*QGPT, "parallelism=ddp", f"cluster.devices={devices}"]))
        assert valid.cfg.parallelism.strategy == "fsdp" and (valid.dims.dp_replicate, valid.dims.dp_shard) == (
            devices,
            1,
        )
        err = capfd.readouterr().err
        assert err.startswith("note: model.lora.quantize=nf4 needs a checkpoint folder") and err.count("\n") == 1
    again = validate(valid.cfg)  # a resolved config resolves to itself, silently
    assert again.dims == valid.dims and capfd.readouterr().err == ""
    with pytest.raises(
        ValueError,
        match=r"^model.lora.quantize=nf4 with parallelism.ddp.comm_hook=fp16: .* set parallelism.ddp.comm_hook=null",
    ):
        validate(compose_config([*QGPT, "parallelism=ddp", "parallelism.ddp.comm_hook=fp16"]))


def test_the_planner_holds_the_qlora_base_whole_in_4_bits(tmp_path) -> None:
    from lightning_dist.config.build import planned_model
    from lightning_dist.config.validate import build_parallel_dims
    from lightning_dist.plan.memory import block_linear_params, count_local_params, estimate_memory

    transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             tie_word_embeddings=False).save_pretrained(tmp_path)  # fmt: skip
    recipe = ["recipe=llama_8b_lora_chat", "model.pretrained=null", f"model.config={tmp_path}",
              f"data.path={tmp_path / 'chats.jsonl'}", "data.micro_batch_size=2"]  # fmt: skip
    estimates = {}
    for name, extra in {"lora": [], "qlora": ["model.lora.quantize=nf4"]}.items():
        for devices in (1, 8):
            cfg = compose_config([*recipe, *extra, f"cluster.devices={devices}"])
            dims, options, model = build_parallel_dims(cfg), cfg.parallelism, planned_model(cfg.model)
            base = count_local_params(model, dp_shard=dims.dp_shard)
            estimates[name, devices] = estimate_memory(model, dims, options, local_params=base, seq_len=2048,
                                                       micro_batch=2)  # fmt: skip
    linears = 32 * block_linear_params(model)
    assert linears == pytest.approx(6.98e9, rel=0.01)  # what QLoRA quantizes of Llama 3.1 8B
    for devices in (1, 8):  # the linear weights whole in NF4 (0.52 byte each) in place of their fp32 share
        lora, qlora = estimates["lora", devices], estimates["qlora", devices]
        assert qlora.params - lora.params == pytest.approx(linears * (NF4_BYTES_PER_PARAM - 4 / devices), rel=1e-6)
        assert (qlora.grads, qlora.optimizer, qlora.activations) == (lora.grads, lora.optimizer, lora.activations)
    gib = estimates["qlora", 1].gib()
    assert gib["params"] == pytest.approx(7.4, abs=0.05) and gib["total"] == pytest.approx(19.1, abs=0.05)
    assert estimates["lora", 1].gib()["total"] == pytest.approx(43.8, abs=0.05)  # the LoRA recipe's 1-GPU number
