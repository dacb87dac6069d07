"""``parallelism.cp`` from the config: what runs, and each case that cannot, one line before launch; which cp attention
runs where (torch's ring attention on CUDA, the all-gather one elsewhere) and that our sequence split is torch's."""

from __future__ import annotations

import pytest
import torch
from helpers import FAST, compose_config

from lightning_dist.config.validate import validate
from lightning_dist.parallel.context_attention import TorchRingAttention, head_tail_positions
from lightning_dist.parallel.options import ContextOptions

HF = [o for o in FAST if not o.startswith("model.")] + ["model=hf"]


# GPT-2 (learned positions, no rotary) is exact under cp2 in the family matrix since the cp attention is found by
# module, not by the Llama layout; the families it refuses under cp are tests/foreign/test_hf_families.py's.
@pytest.mark.parametrize(
    "model",
    [[], ["model=hf", "model.config=tiny_llama"], ["model=hf", "model.config=tiny_gpt2"]],
    ids=["gpt", "hf_llama", "hf_gpt2"],
)
def test_cp_lays_out_the_sequence_axis(model):
    base = HF if model else FAST
    valid = validate(compose_config([*base, *model, "parallelism=fsdp", "parallelism.cp=2"]))
    assert (valid.dims.cp, valid.dims.dp_shard, valid.parallelism.context.attention) == (2, 1, "auto")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*FAST, "parallelism.cp=2"], r"^parallelism.cp=2 is not possible with parallelism.strategy=ddp"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "data.seq_len=30"],
         r"^data.seq_len=30 is not divisible by 2 x cp = 4"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "model.arch=gpt2"], r"^cp=2 with model.arch='gpt2'"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "parallelism.context.attention=ring"],
         r"^parallelism.context.attention='ring' is unknown"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "parallelism.context.attention=torch"],
         r"^parallelism.context.attention=torch runs torch's ring attention, whose kernels are CUDA's .* the ranks "
         r"run on cpu; set parallelism.context.attention=allgather or auto\.$"),
        ([*FAST, "parallelism=fsdp", "parallelism.cp=2", "parallelism.context.rotate=alltoall"],
         r"^parallelism.context.rotate=alltoall is for torch's ring attention, but parallelism.context.attention=auto "
         r"runs the all-gather attention on cpu; set parallelism.context.rotate=allgather\.$"),
    ],
)  # fmt: skip
def test_a_cp_config_that_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_config(overrides))


def test_auto_is_torchs_ring_on_cuda_and_the_all_gather_elsewhere():
    def resolve(attention: str, rotate: str, device: str) -> str:
        return ContextOptions(attention, rotate).resolve(device)

    assert resolve("auto", "allgather", "cuda") == resolve("auto", "alltoall", "gpu") == "torch"
    assert resolve("torch", "alltoall", "cuda") == "torch"
    assert resolve("auto", "allgather", "cpu") == resolve("allgather", "allgather", "cuda")
    assert resolve("auto", "allgather", "cpu") == "allgather"
    with pytest.raises(ValueError, match=r"^parallelism.context.attention=torch runs .* the ranks run on cpu; set "):
        resolve("torch", "allgather", "cpu")
    with pytest.raises(ValueError, match=r"^parallelism.context.rotate='ring' is unknown; use allgather, alltoall\.$"):
        resolve("torch", "ring", "cuda")


def test_cp_rotate_reaches_the_options():
    cfg = compose_config([*FAST, "parallelism=fsdp", "parallelism.cp=2", "parallelism.context.attention=torch",
                          "parallelism.context.rotate=alltoall"])  # fmt: skip
    assert cfg.parallelism.context.rotate == "alltoall"  # the composed config is the strategies' options


@pytest.mark.parametrize(("seq_len", "cp"), [(8, 2), (24, 3), (64, 4)])
def test_the_head_tail_split_is_torchs_load_balancer_order(seq_len: int, cp: int):
    """torch's ring attention assumes its own head-tail layout; our shards go to it unpermuted: the two must agree."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    torchs = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].view(cp, -1)
    for rank in range(cp):
        assert torch.equal(torchs[rank].long(), head_tail_positions(seq_len, cp, rank))


def test_torchs_ring_dispatcher_is_on_while_a_torch_attention_is_in_place():
    """The cp attention turns torch's process-wide CP dispatcher (and its rotate method) on while it is in use."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import _attention as torch_cp

    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    handlers = DTensor._op_dispatcher
    first, second = TorchRingAttention(None, "alltoall"), TorchRingAttention(None, "alltoall")  # type: ignore[arg-type]
    assert flash not in handlers._custom_op_handlers
    first.enable()
    second.enable()
    assert flash in handlers._custom_op_handlers and torch_cp._cp_options.enable_load_balance
    assert torch_cp._cp_options.rotate_method == torch_cp._RotateMethod.ALL_TO_ALL
    first.disable()
    assert flash in handlers._custom_op_handlers  # the second still runs
    second.disable()
    assert flash not in handlers._custom_op_handlers
    assert torch_cp._cp_options.rotate_method == torch_cp._RotateMethod.ALL_GATHER  # torch's default again
