"""``parallelism.cp`` from the config: what runs, and each case that cannot, one line before launch."""

from __future__ import annotations

import pytest
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate

HF = [o for o in FAST if not o.startswith("model.")] + ["model=hf"]


@pytest.mark.parametrize("model", [[], ["model=hf", "model.config=tiny_llama"]], ids=["gpt", "hf_llama"])
def test_cp_lays_out_the_sequence_axis(model):
    base = HF if model else FAST
    valid = validate(compose_config([*base, *model, "parallelism=fsdp", "parallelism.cp=2"]))
    assert (valid.dims.cp, valid.dims.dp_shard, valid.options.cp_attention) == (2, 1, "allgather")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*FAST, "parallelism.cp=2"], r"^parallelism.cp=2 is not possible with parallelism.strategy=ddp"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "data.seq_len=30"],
         r"^data.seq_len=30 is not divisible by 2 x cp = 4"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "model.arch=gpt2"], r"^cp=2 with model.arch='gpt2'"),
        ([*HF, "model.config=tiny_gpt2", "parallelism=fsdp", "parallelism.cp=2"],
         r"^cp=2 with a HuggingFace 'gpt2' model: .* set cp=1"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "parallelism.cp_attention=ring"],
         r"^parallelism.cp_attention='ring' is unknown"),
    ],
)  # fmt: skip
def test_a_cp_config_that_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_config(overrides))
