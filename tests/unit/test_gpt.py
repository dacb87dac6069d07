"""Unit tests of the reference GPT (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_dist.models.gpt import GPT, GPTConfig

TINY = {"vocab_size": 64, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 16}


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_output_shapes(arch: str) -> None:
    model = GPT(tiny(arch=arch))
    tokens = torch.randint(0, 64, (3, 10))
    assert model(tokens).shape == (3, 10, 64)
    assert model(torch.randint(0, 64, (3, 16))).shape == (3, 16, 64)  # T == max_seq_len
    assert (model.pos_emb is None) == (arch == "llama")
    assert (model.rope_cos is None) == (arch == "gpt2")
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_module_names() -> None:
    names = {name for name, _ in GPT(tiny()).named_parameters()}
    assert {"tok_emb.weight", "head.weight", "norm.weight", "layers.1.attn_norm.weight"} <= names
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.0.attn.{proj}.weight" in names
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"layers.0.mlp.{proj}.weight" in names
    assert not any(name.endswith("bias") for name in names)
    gpt2 = {name for name, _ in GPT(tiny(arch="gpt2")).named_parameters()}
    assert {"pos_emb.weight", "layers.0.mlp.up_proj.bias", "norm.bias"} <= gpt2
    assert "layers.0.mlp.gate_proj.weight" not in gpt2 and "head.bias" not in gpt2


def test_grouped_query_attention() -> None:
    model = GPT(tiny(n_kv_heads=2))
    attn = model.layers["0"].attn
    assert attn.q_proj.out_features == 32 and attn.k_proj.out_features == 16 and attn.v_proj.out_features == 16
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)


def test_grouped_query_attention_matches_repeated_heads() -> None:
    """GQA with K heads equals full attention whose k/v weights repeat each kv head H/K times."""
    torch.manual_seed(0)
    gqa = GPT(tiny(n_kv_heads=2)).double()
    mha = GPT(tiny()).double()
    state = gqa.state_dict()
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            key = f"layers.{i}.attn.{proj}.weight"
            state[key] = state[key].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_sharded_heads_infer_head_count() -> None:
    """Attention reads head counts from shapes: half the heads (as on a tensor-parallel rank) still runs."""
    cfg = tiny(n_kv_heads=2)
    attn = GPT(cfg).layers["0"].attn
    for name in ("q_proj", "k_proj", "v_proj"):
        full = getattr(attn, name)
        half = torch.nn.Linear(full.in_features, full.out_features // 2, bias=False)
        setattr(attn, name, half)
    attn.o_proj = torch.nn.Linear(16, 32, bias=False)
    out = attn(torch.randn(2, 8, 32), GPT(cfg).rope_cos, GPT(cfg).rope_sin)
    assert out.shape == (2, 8, 32)


def test_tied_embeddings_share_storage() -> None:
    model = GPT(tiny(tie_embeddings=True))
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert GPT(tiny()).head.weight.data_ptr() != GPT(tiny()).tok_emb.weight.data_ptr()
    # to_empty breaks the tie; init_weights restores it
    with torch.device("meta"):
        meta = GPT(tiny(tie_embeddings=True))
    meta.to_empty(device="cpu")
    meta.init_weights(0)
    assert meta.head.weight is meta.tok_emb.weight


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal(arch: str) -> None:
    model = GPT(tiny(arch=arch)).double()
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


LLAMA3_8B = GPTConfig(
    arch="llama", vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336
)
LLAMA32_1B = GPTConfig(
    arch="llama",
    vocab_size=128256,
    n_layers=16,
    d_model=2048,
    n_heads=32,
    n_kv_heads=8,
    ffn_hidden=8192,
    tie_embeddings=True,
)
GPT2_124M = GPTConfig(
    arch="gpt2", vocab_size=50257, n_layers=12, d_model=768, n_heads=12, max_seq_len=1024, tie_embeddings=True
)


@pytest.mark.parametrize(
    ("cfg", "total"),
    [(LLAMA3_8B, 8_030_261_248), (LLAMA32_1B, 1_235_814_400), (GPT2_124M, 124_439_808)],
    ids=["llama3-8b", "llama3.2-1b", "gpt2-124m"],
)
def test_param_counts_on_meta(cfg: GPTConfig, total: int) -> None:
    """Published totals; the non-embedding count drops the token embedding unless it is tied (it is then the head)
    and the position embedding."""
    with torch.device("meta"):
        model = GPT(cfg)
    assert next(model.parameters()).is_meta
    assert model.num_params(exclude_embedding=False) == total
    excluded = cfg.vocab_size * cfg.d_model if not cfg.tie_embeddings else 0
    excluded += cfg.max_seq_len * cfg.d_model if cfg.arch == "gpt2" else 0
    assert model.num_params() == total - excluded


def test_default_ffn_hidden() -> None:
    assert GPTConfig(d_model=64).hidden_dim == 192  # int(8/3 * 64) = 170 -> next multiple of 32
    assert GPTConfig(d_model=4096, multiple_of=256).hidden_dim == 11008  # Llama-2-7B
    assert GPTConfig(arch="gpt2", d_model=768).hidden_dim == 3072
    assert GPTConfig(ffn_hidden=100).hidden_dim == 100


def test_flops_per_token() -> None:
    cfg = tiny(n_kv_heads=2)
    model = GPT(cfg)
    C, F, L, V = 32, cfg.hidden_dim, 2, 64
    per_layer = C * C + 2 * C * 16 + C * C + 3 * C * F + 2 * C  # q, k+v, o, mlp, norms
    n = L * per_layer + C + V * C  # + final norm + head (token embedding excluded)
    assert model.num_params() == n
    assert model.flops_per_token(16) == 6 * n + 12 * L * 4 * 8 * 16


def test_init_determinism() -> None:
    a, b = GPT(tiny()), GPT(tiny())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    a.init_weights(1)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)
    b.init_weights(1)
    assert torch.equal(a.tok_emb.weight, b.tok_emb.weight)
    # distinct draws per parameter, GPT-2 scaled output projections, unit norms
    assert not torch.equal(a.layers["0"].attn.q_proj.weight, a.layers["1"].attn.q_proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(32))
    assert a.layers["0"].attn.o_proj.weight.std() < 0.5 * a.layers["0"].attn.q_proj.weight.std()


@pytest.mark.parametrize("tie", [False, True])
def test_stage_built_alone_matches_full_model(tie: bool) -> None:
    cfg = tiny(tie_embeddings=tie)
    full = GPT(cfg)
    full.init_weights(7)
    with torch.device("meta"):
        stage = GPT(cfg)
    del stage.layers["0"]
    stage.tok_emb = None
    stage.to_empty(device="cpu")
    stage.init_weights(7)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    names = [name for name, _ in stage.named_parameters()]
    assert names and all(name.startswith(("layers.1.", "norm.", "head.")) for name in names)
    for name, param in stage.named_parameters():
        assert torch.equal(param, full_params[name]), name
    torch.testing.assert_close(stage.rope_cos, full.rope_cos, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_float64(arch: str) -> None:
    full = GPT(tiny(arch=arch))
    with torch.device("meta"):
        meta = GPT(tiny(arch=arch))
    meta = meta.to_empty(device="cpu").double()
    meta.init_weights(0)
    for (name, a), (_, b) in zip(full.named_parameters(), meta.named_parameters()):
        assert b.dtype == torch.float64
        assert torch.equal(a.double(), b), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pipeline_stages_compose(arch: str) -> None:
    cfg = tiny(arch=arch)
    full = GPT(cfg).double()
    stage_a = GPT(cfg).double()  # first stage: embeddings + layer 0
    del stage_a.layers["1"]
    stage_a.norm = None
    stage_a.head = None
    stage_b = GPT(cfg).double()  # last stage: layer 1 + norm + head
    del stage_b.layers["0"]
    stage_b.tok_emb = None
    stage_b.pos_emb = None
    tokens = torch.randint(0, 64, (2, 12))
    hidden = stage_a(tokens)
    assert hidden.shape == (2, 12, 32)
    torch.testing.assert_close(stage_b(hidden), full(tokens))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_heads": 6, "d_model": 64}, r"model.n_heads=6 must divide model.d_model=64"),
        ({"n_kv_heads": 3}, r"model.n_kv_heads=3 must divide model.n_heads=4"),
        ({"arch": "mamba"}, r"model.arch='mamba' is unknown.*llama.*gpt2"),
        ({"n_layers": 0}, r"model.n_layers=0"),
        ({"d_model": 36, "n_heads": 4}, r"head_dim 9 is odd"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**overrides).validate()
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**overrides))


def test_an_hf_llama_counts_the_flops_of_the_built_in_gpt_of_its_shape() -> None:
    """model=hf's MFU counts as the GPT's: a 9% low count (all parameters, no attention term) was found on a GPU."""
    transformers = pytest.importorskip("transformers")
    from lightning_dist.models.gpt_hf import hf_config
    from lightning_dist.models.hf import HFCausalLM

    cfg = tiny(n_kv_heads=2)
    fields = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type")}
    model = HFCausalLM(transformers.LlamaConfig(**fields))
    assert model.flops_per_token(32) == GPT(cfg).flops_per_token(32) != 6 * GPT(cfg).num_params(exclude_embedding=False)
