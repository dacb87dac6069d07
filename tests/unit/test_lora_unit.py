"""LoRA's parts without a process group: the adapters' tensor-parallel styles, their one-process values, the layers
they adapt, merging, and what is refused before launch."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import FAST, compose_config
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_dist.config.validate import validate
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.lora import apply_lora, merged, resolve_targets
from lightning_dist.models.lora_config import LoraConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.lora import adapter_plan
from lightning_dist.parallel.tensor import ReplicateParallel, ReplicateShardedInput

pytest.importorskip("peft")


def _gpt(lora: LoraConfig, meta: bool = False) -> GPTModule:
    module = GPTModule(GPTConfig(lora=lora), OptimConfig(), 10, init_seed=3)
    if meta:
        with torch.device("meta"):
            module.configure_model()
        module.model.to_empty(device="cpu")
        module.reset_parameters()
    else:
        module.configure_model()
    return module


def test_adapters_take_the_styles_their_base_layer_implies() -> None:
    module = _gpt(LoraConfig(rank=4, targets=["q_proj", "o_proj", "down_proj"]))
    seq = Shard(1)
    plan = adapter_plan(
        module,
        {
            "model.layers.0.attn.q_proj": ColwiseParallel(),
            "model.layers.0.attn.o_proj": RowwiseParallel(output_layouts=seq),  # sequence parallelism
            "model.layers.0.mlp.down_proj": RowwiseParallel(),
            "model.layers.0.attn.k_proj": ColwiseParallel(),  # not adapted: unchanged
        },
    )
    q = "model.layers.0.attn.q_proj"
    assert isinstance(plan[f"{q}.base_layer"], ColwiseParallel) and f"{q}" not in plan
    assert isinstance(plan[f"{q}.lora_A.default"], ReplicateParallel)  # A whole: its r outputs are all needed
    b = plan[f"{q}.lora_B.default"]
    assert isinstance(b, ColwiseParallel) and b.output_layouts == (Shard(-1),)  # B A x sharded as W x is
    o = "model.layers.0.attn.o_proj"
    a = plan[f"{o}.lora_A.default"]
    assert isinstance(a, RowwiseParallel) and a.input_layouts == (Shard(-1),) and a.output_layouts == (seq,)
    assert isinstance(plan[f"{o}.lora_B.default"], ReplicateShardedInput)  # on the sequence shard: grads summed
    assert plan[f"{o}.lora_B.default"].input_dim == 1
    d = "model.layers.0.mlp.down_proj"
    assert plan[f"{d}.lora_A.default"].output_layouts == (Replicate(),)
    assert isinstance(plan[f"{d}.lora_B.default"], ReplicateParallel)
    assert isinstance(plan["model.layers.0.attn.k_proj"], ColwiseParallel)
    with pytest.raises(ValueError, match=r"^model.lora.targets: model.layers.0.attn.q_proj is sharded with Seq"):
        adapter_plan(module, {q: SequenceParallel()})


def test_adapters_start_at_their_one_process_values_whatever_the_build() -> None:
    lora = LoraConfig(rank=4, alpha=8)
    real, meta = _gpt(lora), _gpt(lora, meta=True)
    a_names = [n for n, _ in real.named_parameters() if ".lora_A." in n]
    assert len(a_names) == 2 * 7  # every linear layer of both blocks, not the head
    for (name, p), (_, q) in zip(real.named_parameters(), meta.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        assert p.requires_grad == (".lora_" in name), name  # the base frozen: no gradient, no optimizer state
        if ".lora_B." in name:
            assert not p.any()
        elif ".lora_A." in name:
            bound = 1 / math.sqrt(p.shape[1])  # peft's kaiming_uniform_(a=sqrt(5))
            assert 0 < p.abs().max() <= bound
    optimizer = real.configure_optimizers()["optimizer"]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in real.named_parameters() if ".lora_" in n}


def test_merging_folds_the_scaled_update_into_the_weight() -> None:
    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    torch.testing.assert_close(merged(w, a, b, 4.0), w + 4.0 * b @ a)
    torch.testing.assert_close(merged(w.T, a, b, 4.0, fan_in_fan_out=True), (w + 4.0 * b @ a).T)


def test_targets_name_linear_layers_only() -> None:
    model = _gpt(LoraConfig()).model
    assert resolve_targets(model, ["v_proj"], "layers") == ["layers.0.attn.v_proj", "layers.1.attn.v_proj"]
    assert "head" not in resolve_targets(model, None, "layers")
    with pytest.raises(ValueError, match=r"^model.lora.targets: 'qkv' names no layer of GPT; its linear layers"):
        resolve_targets(model, ["qkv"], "layers")
    with pytest.raises(ValueError, match=r"^model.lora.targets: tok_emb is a Embedding; LoRA here adapts linear"):
        apply_lora(model, LoraConfig(rank=2, targets=["tok_emb"]), "layers")
    assert isinstance(model.tok_emb, nn.Embedding)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.dropout=1.5", r"^model.lora.dropout=1.5 must be in \[0, 1\)"),
        ("model.lora.alpha=0", r"^model.lora.alpha=0.0 must be positive"),
        ("parallelism.float8=rowwise", r"^model.lora with parallelism.float8=rowwise: float8 LoRA is not supported"),
    ],
)
def test_bad_lora_values_stop_before_launch_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        validate(compose_config([*FAST, "model.lora.rank=8", override]))
    assert "\n" not in str(err.value)


def test_the_planner_counts_gradients_and_optimizer_state_for_the_adapters_only() -> None:
    from dataclasses import replace

    from lightning_dist.parallel.options import Parallelism
    from lightning_dist.parallel_dims import ParallelDims
    from lightning_dist.plan.memory import count_local_params, estimate_memory, lora_block_params

    cfg = GPTConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, vocab_size=512)
    tuned = replace(cfg, lora=LoraConfig(rank=8))
    module = _gpt(LoraConfig(rank=8))  # the tiny GPT's real adapters: the count is exact
    real = sum(p.numel() for n, p in module.named_parameters() if ".lora_" in n)
    assert lora_block_params(module.model_config) * module.model_config.n_layers == real
    for tp, dp_shard in ((1, 1), (2, 1), (1, 4)):
        dims = ParallelDims(tp=tp, dp_shard=dp_shard, world_size=tp * dp_shard)
        local = count_local_params(cfg, tp, dp_shard)
        full = estimate_memory(cfg, dims, Parallelism(), local_params=local, seq_len=64, micro_batch=2)
        lora = estimate_memory(tuned, dims, Parallelism(), local_params=local, seq_len=64, micro_batch=2)
        adapters = 4 * lora_block_params(tuned, tp) // dp_shard
        assert lora.optimizer == 8 * adapters < full.optimizer / 5
        assert lora.grads == 4 * adapters and lora.params == 4 * (local + adapters)


def test_adapters_stay_float32_on_a_bf16_base_through_the_precision_s_conversion() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as bf16-true's init context builds the model
    try:
        module = _gpt(LoraConfig(rank=4), meta=True)
    finally:
        torch.set_default_dtype(previous)
    kinds = {(".lora_" in name, p.dtype, p.requires_grad) for name, p in module.named_parameters()}
    assert kinds == {(True, torch.float32, True), (False, torch.bfloat16, False)}
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    module.to(dtype=torch.bfloat16)  # Lightning's HalfPrecision.convert_module; then a move
    module.to("cpu", torch.bfloat16)
    assert {(".lora_" in n, p.dtype) for n, p in module.named_parameters()} == {
        (True, torch.float32),
        (False, torch.bfloat16),
    }
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # no round trip through bf16
    module.to(torch.float64)  # 64-true converts everything
    assert {p.dtype for p in module.parameters()} == {torch.float64}
