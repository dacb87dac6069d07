"""Context parallelism for HuggingFace Llama-family models (transformers' attention-function hook, global
``position_ids``): cp2 and cp2 x tp2 train a tiny Llama exactly as one process does with its own (sdpa) attention;
models the cp attention cannot serve are refused in one line; after its fit a module (HF or our GPT) computes alone as
before. Also torch's ring attention schedule on our head-tail shards (CPU kernel). One spawned group per size."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy, _compat
from lightning_dist.contract import declared_cp_spec
from lightning_dist.models.gpt import GPT, GPTConfig, causal_attention
from lightning_dist.models.gpt_parallel import gpt_context_parallel_spec
from lightning_dist.models.hf import HFCausalLM
from lightning_dist.models.hf_context import ATTRIBUTE, CP_ATTENTION, cp_attention_forward
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.context import apply_context_parallel, shard_sequence, undo_context_parallel
from lightning_dist.parallel.options import ContextOptions
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.run.launch import launch

SEQ, BATCH, STEPS, VOCAB = 32, 2, 3, 64


def _config(family: str = "Llama", **extra: Any) -> Any:
    import transformers

    sizes = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ}  # fmt: skip
    return getattr(transformers, f"{family}Config")(**{**sizes, **extra})


class LocalPositions(HFCausalLM):
    """The cp spec without its global ``position_ids``: the rotary embedding sees ``arange(T_local)`` (a control)."""

    def context_parallel_spec(self) -> Any:
        from dataclasses import replace

        return replace(super().context_parallel_spec(), position_ids=None)


class Record(pl.Callback):
    """Each step's logged loss and gradient norm, its gradients (whole), and the attention implementation that ran."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.grads: list[dict[str, np.ndarray]] = []
        self.attention = ""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: _whole(p.grad).detach().numpy().copy() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))
        self.attention = _compat.attn_implementation(pl_module.model.config)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fit(
    devices: int,
    family: str = "Llama",
    module_class: type[HFCausalLM] = HFCausalLM,
    options: dict[str, Any] | None = None,
    module: HFCausalLM | None = None,
    **degrees: int,
) -> dict[str, Any]:
    """Train a tiny model of ``family`` (built from its config, initialized by parameter name: the same weights in
    every layout; or ``module``) ``STEPS`` steps on the same ``(inputs, targets)`` batches of ``SEQ`` tokens under
    ``degrees`` (and strategy ``options``)."""
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    dp = ParallelDims(devices, **{"dp_shard": 1, **degrees}).dp_size  # a loader's batch is per data-parallel rank
    record = Record()
    strategy = MeshStrategy(**{"dp_shard": 1, **degrees}, **(options or {}))
    trainer = quiet_trainer(strategy, devices, STEPS, [record], precision="32-true")
    module = module or module_class(_config(family), OptimConfig(lr=1e-3, warmup_steps=1), max_steps=STEPS)
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // dp))
    describe = "\n".join(strategy.describe().lines())
    return {"losses": record.losses, "norms": record.norms, "grads": record.grads, "attention": record.attention,
            "describe": describe}  # fmt: skip


def _used_alone_after_fit() -> dict[str, Any]:
    """A cp2 fit, then the same module on whole sequences in each rank: what is left of context parallelism in it,
    and its logits' gap to a fresh copy of its trained weights (FSDP2 still gathers its parameters); then
    ``trainer.validate`` on the same trainer (cp made again for it) and its loss against the fresh copy's."""
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    module = HFCausalLM(_config(), OptimConfig(lr=1e-3, warmup_steps=1), max_steps=STEPS)
    trainer = quiet_trainer(MeshStrategy(dp_shard=1, cp=2), 2, STEPS, precision="32-true")
    trainer.fit(module, loader)
    whole = {name: _whole(tensor).detach() for name, tensor in module.model.state_dict().items()}
    fresh = HFCausalLM(_config())
    fresh.configure_model()
    fresh.model.load_state_dict(whole)
    with torch.no_grad():
        got, want = (m.model(input_ids=tokens[:, :-1], use_cache=False).logits for m in (module, fresh))
        fresh_loss = float(torch.stack([fresh.compute_loss(batch) for batch in loader]).mean())
    hooks = [h for m in module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    left = {"attention": _compat.attn_implementation(module.model.config),
            "cp_attributes": sum(hasattr(m, ATTRIBUTE) for m in module.modules()),
            "cp_hooks": [h.__qualname__ for h in hooks if "Global" in getattr(h, "__qualname__", "")]}  # fmt: skip
    validated = trainer.validate(module, loader, verbose=False)[0]["val/loss"]
    return {**left, "gap": float((got - want).abs().max()), "val_loss": (validated, fresh_loss),
            "after_validate": _compat.attn_implementation(module.model.config)}  # fmt: skip


def _gpt_applied_undone_redone() -> dict[str, Any]:
    """Our GPT's cp changes applied, undone and made again: its outputs on this rank's shard (cp) or whole (alone)
    against its own one-process outputs; and ``context.attention=torch`` refused on gloo before any change."""
    gpt = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=SEQ))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    rank, spec, group = dist.get_rank(), gpt_context_parallel_spec(""), dist.group.WORLD
    try:
        apply_context_parallel(gpt, spec, group, ContextOptions(attention="torch"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    with torch.no_grad():
        alone = gpt(tokens)
        describe = apply_context_parallel(gpt, spec, group)
        gaps = {"cp": float((gpt(shard_sequence(tokens, 2, rank)) - shard_sequence(alone, 2, rank)).abs().max())}
        undone = undo_context_parallel(gpt)
        gaps["undone"] = float((gpt(tokens) - alone).abs().max())
        originals = all(layer.attn.attention_fn is causal_attention for layer in gpt.layers.values())
        redone = (len(undone), undone.redo(), undone.redo())  # made again once
        gaps["redone"] = float((gpt(shard_sequence(tokens, 2, rank)) - shard_sequence(alone, 2, rank)).abs().max())
        undo_context_parallel(gpt)
    return {"refused": refused, "describe": describe, "gaps": gaps, "originals": originals, "changes": redone,
            "hooks": len(gpt._forward_pre_hooks) + len(gpt._forward_hooks)}  # fmt: skip


def _torchs_ring_on_our_shards() -> dict[str, float]:
    """torch's ring attention schedule (the code around each kernel call of its CUDA path) with CPU's flash kernel, on
    our head-tail shards, per rotate method; and on contiguous shards (a control): gaps to one process's attention."""
    from torch.distributed.tensor.experimental import _attention as torch_cp

    rank, generator = dist.get_rank(), torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(BATCH, 4, SEQ, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    splits = {"head-tail": lambda t: shard_sequence(t, 2, rank, dim=2), "contiguous": lambda t: t.chunk(2, dim=2)[rank]}
    gaps = {}
    for name, rotate, split in [("allgather", "allgather", "head-tail"), ("alltoall", "alltoall", "head-tail"),
                                ("contiguous", "allgather", "contiguous")]:  # fmt: skip
        _compat.torch_ring_attention(True, rotate)
        shards = [splits[split](t) for t in (q, k, v)]
        out = torch_cp._templated_ring_attention(dist.group.WORLD, 2, kernel, *shards, is_causal=True)[0]
        _compat.torch_ring_attention(False)
        gaps[name] = float((out - splits[split](want)).abs().max())
    return gaps


def _one_rank() -> dict[str, Any]:
    return {family: _fit(1, family) for family in ("Llama", "Qwen2")}


def _two_ranks() -> dict[str, Any]:
    out = {"cp2": _fit(2, cp=2), "cp2-qwen2": _fit(2, "Qwen2", cp=2)}
    out["cp2-ac"] = _fit(
        2, options={"activation_checkpointing": {"mode": "full"}}, cp=2
    )  # the recomputation all-gathers again
    out["alone"] = _used_alone_after_fit()  # the same module alone after a cp2 fit
    out["gpt"], out["torch_ring"] = _gpt_applied_undone_redone(), _torchs_ring_on_our_shards()
    return {**out, "local_positions": _fit(2, module_class=LocalPositions, cp=2)}


def _four_ranks() -> dict[str, Any]:
    return {"cp2xtp2": _fit(4, cp=2, tp=2), "cp2xfsdp2": _fit(4, cp=2, dp_shard=2), "pp2xcp2": _fit(4, pp=2, cp=2)}


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    return launch(_one_rank, 1)[0]


@pytest.fixture(scope="module")
def reference(one_rank: dict[str, Any]) -> dict[str, Any]:
    return one_rank["Llama"]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return launch(_four_ranks, 4)


def _assert_same_run(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
    np.testing.assert_allclose(run["norms"], reference["norms"], rtol=1e-5)
    for step, (got, want) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        assert got.keys() <= want.keys() and got  # under pp: this rank's stage's parameters
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=f"step {step} {name}")


def test_cp2_matches_one_process_sdpa(two_ranks: list, one_rank: dict) -> None:
    assert one_rank["Llama"]["attention"] == one_rank["Qwen2"]["attention"] == "sdpa"  # transformers' own attention
    for rank in two_ranks:
        assert rank["cp2"]["attention"] == CP_ATTENTION
        _assert_same_run(rank["cp2"], one_rank["Llama"])
        _assert_same_run(rank["cp2-ac"], one_rank["Llama"])
        _assert_same_run(rank["cp2-qwen2"], one_rank["Qwen2"])
    describe = two_ranks[0]["cp2"]["describe"]
    assert "context parallel cp=2: head-tail sequence split; 2 attention modules: all-gather" in describe
    assert "(context.attention=auto on cpu: torch's ring attention has CUDA kernels only)" in describe  # what runs, why


def test_a_module_computes_alone_as_before_after_its_cp_fit(two_ranks: list) -> None:
    # The strategy's teardown undid every cp change (attention functions, hooks, transformers' attention routing).
    for rank in two_ranks:
        alone = rank["alone"]
        assert (alone["attention"], alone["cp_attributes"], alone["cp_hooks"]) == ("sdpa", 0, [])
        assert alone["gap"] < 1e-5, alone["gap"]  # the cp attention on a whole sequence would gather it twice
        np.testing.assert_allclose(*alone["val_loss"], rtol=1e-5)  # validate after fit: split and cp again
        assert alone["after_validate"] == "sdpa"
        gpt = rank["gpt"]
        assert gpt["gaps"]["cp"] < 1e-5 and gpt["gaps"]["redone"] < 1e-5  # applied, and made again after the undo
        assert gpt["gaps"]["undone"] == 0.0 and gpt["originals"] and gpt["hooks"] == 0
        assert gpt["changes"] == (3, 3, 0)  # 2 attention functions and the RoPE tables' hooks, made again once
        assert gpt["refused"].startswith(
            "parallelism.context.attention=torch runs torch's ring attention, whose kernels"
        )
        assert gpt["refused"].endswith("the ranks run on cpu; set parallelism.context.attention=allgather or auto.")


def test_torchs_ring_schedule_on_our_head_tail_shards_is_exact(two_ranks: list) -> None:
    # torch's ring (load balanced) on our shards as they are: one process's attention, up to its fp32 merge; the same
    # ring on contiguous shards (not torch's layout) is wrong, so the order is what makes it exact.
    for rank in two_ranks:
        ring = rank["torch_ring"]
        assert ring["allgather"] < 1e-6 and ring["alltoall"] < 1e-6, ring
        assert ring["contiguous"] > 0.1, ring


def _largest_gradient_gap(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest difference of a first-step gradient from the reference's, relative to that gradient's largest."""
    got, want = run["grads"][0], reference["grads"][0]
    return max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)


def test_cp2_needs_global_positions(two_ranks: list, reference: dict) -> None:
    # The control: the same cp attention with HF's local arange(T / cp) positions. A tiny random model's loss barely
    # depends on positions (1e-5), its gradients do: the comparison above checks the rotary positions.
    for rank in two_ranks:
        assert _largest_gradient_gap(rank["cp2"], reference) < 1e-5
        assert _largest_gradient_gap(rank["local_positions"], reference) > 0.1


@pytest.mark.parametrize("layout", ["cp2xtp2", "cp2xfsdp2", "pp2xcp2"])
def test_cp2_with_tp2_fsdp2_or_pp2_matches_one_process(layout: str, four_ranks: list, reference: dict) -> None:
    """pp2 x cp2: each stage's position ids are its cp rank's global ones (passed to the HF stage forward)."""
    for rank in four_ranks:
        _assert_same_run(rank[layout], reference)
    held = set().union(*(rank[layout]["grads"][0] for rank in four_ranks))
    assert held == reference["grads"][0].keys()


def test_models_the_cp_attention_cannot_serve_are_refused() -> None:
    """Attention is found by module (GPT-2's ``transformer.h.*.attn`` as Llama's ``self_attn``); what cannot be served
    (sliding windows, a family the matrix found inexact under cp2, as ALiBi's Bloom) is refused in one line."""
    import transformers

    gpt2 = HFCausalLM(_config("GPT2", n_embd=32, n_layer=2, n_head=4, n_positions=SEQ))
    gpt2.configure_model()
    assert declared_cp_spec(gpt2, 2).attention == ("model.transformer.h.*.attn",)
    window = HFCausalLM(_config("Mistral", sliding_window=8))
    with pytest.raises(ValueError, match=r"^cp=2 with sliding_window=8: .* or cp=1\.$"):
        declared_cp_spec(window, 2)
    bloom = HFCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match=r"^parallelism.cp=2 with model=hf 'bloom': not exact .*cp2: differs"):
        declared_cp_spec(bloom, 2)
    for family, extra in (("Qwen2", {}), ("Mistral", {"sliding_window": None})):
        model = HFCausalLM(_config(family, **extra))
        model.configure_model()
        spec = declared_cp_spec(model, 2)
        assert spec.attention == ("model.model.layers.*.self_attn",) and spec.position_ids == "model"


def test_cp_attention_refuses_a_padding_mask() -> None:
    q = torch.zeros(1, 4, 8, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=r"^Module runs attn_implementation='lightning_dist_cp' without a cp"):
        cp_attention_forward(module, q, q, q, None)
    scales: list[float | None] = []
    module.context_parallel_attention = lambda q, k, v, scale=None: scales.append(scale) or q
    with pytest.raises(ValueError, match=r"^cp attention got an attention_mask of shape \(1, 8\): .* or set cp=1\.$"):
        cp_attention_forward(module, q, q, q, torch.ones(1, 8, dtype=torch.bool))
    out, weights = cp_attention_forward(module, q, q, q, None, scaling=0.5)
    assert out.shape == (1, 8, 4, 8) and weights is None  # (B, T, H, D), as transformers expects
    assert scales == [0.5]  # transformers' scaling reaches the cp attention
