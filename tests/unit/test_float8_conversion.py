"""float8 training's conversion (torchao, emulated on the CPU): which layers, what stays, and the curve's distance
from high precision (the measured tolerance of ``lightning_dist/parallel/float8.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.parallel.float8 import FLOAT8_LOSS_RTOL, apply_float8, converted_names
from lightning_dist.parallel.options import Parallelism

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

CFG = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)


def test_float8_converts_the_blocks_linears_and_keeps_names_dtypes_and_the_head() -> None:
    model = GPT(CFG)
    before = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    described = apply_float8(list(model.layers.values()), "tensorwise", "cpu", fsdp=False)
    assert described == "float8 tensorwise: 14 linear layers of 2 blocks (emulated)"
    assert len(converted_names(model)) == 14 and all(name.startswith("layers.") for name in converted_names(model))
    assert type(model.head) is nn.Linear and type(model.tok_emb) is nn.Embedding
    # checkpoints: the same names, shapes and the high-precision dtype (a float8 run resumes without it and back)
    assert {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()} == before


def test_a_layer_float8_cannot_multiply_stays_as_it_is() -> None:
    odd = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, n_kv_heads=4, ffn_hidden=40, max_seq_len=8)
    model = GPT(odd)
    apply_float8(list(model.layers.values()), "rowwise", "cpu", fsdp=False)
    assert sorted(converted_names(model)) == [f"layers.0.attn.{p}_proj" for p in "koqv"]  # 40-wide MLP: not / 16


def test_float8_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from helpers import FAST, compose_config

    from lightning_dist.config.validate import validate

    with pytest.raises(ValueError, match=r"^parallelism.float8='fp8' is unknown; use off, tensorwise, rowwise"):
        Parallelism(float8="fp8")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else found(name, *a))
    with pytest.raises(ValueError, match=r"parallelism.float8=rowwise needs torchao; pip install"):
        validate(compose_config([*FAST, "parallelism.float8=rowwise"]))
    with pytest.raises(ValueError, match=r"float8=rowwise converts the linear layers of the model's blocks"):
        apply_float8([], "rowwise", "cpu", fsdp=False)


def _curve(recipe: str) -> list[float]:
    from float8_curve import curve

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: OpenMP threads only wait on each other
    try:
        return curve(recipe, 100, 64)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp32_curve() -> list[float]:
    return _curve("off")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_curve_stays_within_the_stated_tolerance_of_fp32(recipe: str, fp32_curve: list[float]) -> None:
    losses = _curve(recipe)
    assert losses[-1] < 0.5 * losses[0]  # it trains
    assert losses != fp32_curve  # float8 changed the numbers
    np.testing.assert_allclose(losses, fp32_curve, rtol=FLOAT8_LOSS_RTOL)


@pytest.mark.slow  # inductor compiles a float8 block's forward and backward: about a minute on this machine
def test_a_compiled_float8_block_gives_the_eager_float8_numbers() -> None:
    """float8 with compile (issue 37): each block one whole graph (``fullgraph=True``), the eager float8 loss and
    gradients."""
    from lightning_dist.models.loss import token_loss
    from lightning_dist.parallel.compose import compile_blocks

    tiny = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny)
        apply_float8(list(model.layers.values()), "tensorwise", "cpu", fsdp=False)
        if compiled:
            compile_blocks(list(model.layers.values()))
        loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (eager, eager_grads), (compiled_loss, compiled_grads) = results
    assert compiled_loss == pytest.approx(eager, rel=1e-6)
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
