"""``parallelism.sync=diloco`` from the config: the preset, the fields reaching the options, one-line errors."""

from __future__ import annotations

import pytest
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate


def test_the_preset_and_its_fields_reach_the_options():
    overrides = ["parallelism=diloco", "parallelism.diloco.every=20", "parallelism.diloco.fragments=2",
                 "parallelism.diloco.compression=int8", "parallelism.diloco.delay=3"]  # fmt: skip
    valid = validate(compose_config([*FAST, *overrides]))
    options = valid.parallelism
    assert (options.sync, options.diloco.every, options.diloco.fragments) == ("diloco", 20, 2)
    assert (options.diloco.compression, options.diloco.delay, options.diloco.outer_lr) == ("int8", 3, 0.7)
    assert (valid.dims.dp_replicate, valid.dims.dp_shard) == (2, 1)
    assert valid.layout.endswith("(world 2); sync=diloco H=20")  # the start-up line and the report say so


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.sync=diloco"], r"^parallelism.sync=diloco cannot run on Lightning's DDP"),
        (["parallelism=diloco", "cluster.devices=1"], r"^parallelism.sync=diloco .* set parallelism.dp_replicate >= 2"),
        (["parallelism=diloco", "parallelism.diloco.every=0"], r"^parallelism.diloco.every=0 must be >= 1"),
        (["parallelism=diloco", "parallelism.diloco.compression=fp8"],
         r"^parallelism.diloco.compression='fp8' is unknown; use fp32, bf16, int8"),
        (["parallelism.sync=sometimes"], r"^parallelism.sync='sometimes' is unknown"),
    ],
)  # fmt: skip
def test_a_diloco_config_that_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_config([*FAST, *overrides]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.ddp.comm_hook=bf16"], r"^parallelism.ddp.comm_hook=bf16 needs CUDA and NCCL .* use "
                                             r"parallelism.ddp.comm_hook=fp16"),
        (["parallelism=fsdp", "parallelism.ddp.comm_hook=fp16"],
         r"^parallelism.ddp.comm_hook=fp16 is for parallelism=ddp; .* parallelism.fsdp.reduce_dtype=bf16"),
        (["parallelism.fsdp.reduce_dtype=bf16"], r"^parallelism.fsdp.reduce_dtype=bf16 is for FSDP2 layouts"),
    ],
)  # fmt: skip
def test_gradient_compression_that_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_config([*FAST, *overrides]))


def test_gradient_compression_reaches_the_options():
    ddp = validate(compose_config([*FAST, "parallelism.ddp.comm_hook=fp16"]))
    assert ddp.parallelism.ddp.comm_hook == "fp16"
    fsdp = validate(compose_config([*FAST, "parallelism=fsdp", "parallelism.fsdp.reduce_dtype=bf16"]))
    assert fsdp.parallelism.fsdp.reduce_dtype == "bf16"
