"""Initialization does not depend on the default device.

Lightning builds a model under its init context (``trainer.init_module()``), which makes the accelerator the default
device: on a GPU every tensor created without ``device=`` is a CUDA tensor. Our initializers draw each parameter on
the CPU from a generator seeded by its name and copy it into place, so every host tensor they make must say
``device="cpu"``: a ``torch.empty(shape)`` filled by a CPU generator crashed the default GPU job before its first step.
Here the meta device stands in for the GPU: any tensor made without an explicit device lands on it and the copy into
the real parameter fails (or gives other values), on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim_config import OptimConfig

TINY = {"vocab_size": 64, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 16}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _scramble(model: nn.Module) -> None:
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.zero_()


def _assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    actual = _state(model)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("gpt2", False)])
def test_gpt_init_weights_under_another_default_device(arch: str, tied: bool) -> None:
    model = GPT(GPTConfig(**TINY, arch=arch, tie_embeddings=tied))
    expected = _state(model)
    _scramble(model)
    with torch.device("meta"):
        model.init_weights(0)
    _assert_same(model, expected)


def test_gpt_module_reset_parameters_under_another_default_device() -> None:
    module = GPTModule(GPTConfig(**TINY), OptimConfig(), max_steps=10)
    module.configure_model()
    expected = _state(module.model)
    _scramble(module.model)
    with torch.device("meta"):
        module.reset_parameters()
    _assert_same(module.model, expected)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt2", "tiny_qwen2"])
@pytest.mark.parametrize("random", [True, False])
def test_hf_init_under_another_default_device(family: str, random: bool) -> None:
    import transformers

    from lightning_dist.models.hf import TINY_CONFIGS
    from lightning_dist.models.hf_init import causal_lm_class, init_causal_lm

    class_name, kwargs = TINY_CONFIGS[family]
    config = getattr(transformers, class_name)(**kwargs)
    model = causal_lm_class(config)(config)
    init_causal_lm(model, seed=0, random=random)
    expected = _state(model)
    _scramble(model)
    with torch.device("meta"):
        init_causal_lm(model, seed=0, random=random)
    _assert_same(model, expected)
