"""torch's ring attention for context parallelism (``parallelism.context.attention=torch``, what ``auto`` runs on CUDA)
against one process: the attention alone (forward and backward, bf16 flash with grouped-query K/V and fp32, both
rotate methods), and a cp2 training run against the all-gather attention's. Needs 2 GPUs (NCCL)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import FAST, losses, run_app

from lightning_dist.run.launch import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

#: (dtype, rotate, kv heads): bf16 takes flash with K heads as they are; fp32 the efficient kernel (K/V repeated).
CASES = [
    ("bfloat16", "allgather", 2),
    ("bfloat16", "alltoall", 2),
    ("float32", "allgather", 8),
    ("float32", "alltoall", 2),
]


def _attention_gaps(dtype_name: str, rotate: str, kv_heads: int) -> dict[str, Any]:
    """This rank's output and q / k / v gradients from torch's ring attention on its head-tail shards, against one
    process's fp32 causal SDPA on the whole sequence (largest absolute gaps, and the reference's largest values)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_dist.parallel.context import shard_sequence
    from lightning_dist.parallel.context_attention import TorchRingAttention

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("cp",))
    dtype, generator = getattr(torch, dtype_name), torch.Generator().manual_seed(0)
    shapes = [(2, 8, 256, 64), (2, kv_heads, 256, 64), (2, kv_heads, 256, 64), (2, 8, 256, 64)]
    q, k, v, grad = (torch.randn(shape, generator=generator).to("cuda", dtype) for shape in shapes)
    whole = [t.float().requires_grad_() for t in (q, k, v)]  # the reference in fp32, from the same inputs
    reference = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=kv_heads != 8)
    reference.backward(grad.float())
    shards = [shard_sequence(t, 2, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    ring = TorchRingAttention(mesh["cp"], rotate)
    ring.enable()
    out = ring(*shards)
    out.backward(shard_sequence(grad, 2, rank, dim=2))
    ring.disable()
    wanted = [reference, *(t.grad for t in whole)]
    got = [out, *(t.grad for t in shards)]
    gaps = [float((g.float() - shard_sequence(w, 2, rank, dim=2).float()).abs().max()) for g, w in zip(got, wanted)]
    dist.destroy_process_group()
    return {"gaps": gaps, "scale": [float(w.float().abs().max()) for w in wanted]}


@pytest.mark.parametrize(("dtype", "rotate", "kv_heads"), CASES)
def test_torchs_ring_attention_equals_one_process(dtype: str, rotate: str, kv_heads: int) -> None:
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-4  # relative to each tensor's largest value
    for rank in launch(_attention_gaps, 2, dtype, rotate, kv_heads):
        for name, gap, scale in zip(("out", "dq", "dk", "dv"), rank["gaps"], rank["scale"]):
            assert gap <= tolerance * scale, (name, gap, scale)


def test_cp2_training_with_torchs_ring_equals_the_all_gather_attention(tmp_path: Path) -> None:
    base = [*FAST, "trainer.max_steps=5", "cluster=gpu", "cluster.devices=2", "cluster.precision=32-true",
            "parallelism=fsdp", "parallelism.cp=2", "parallelism.dp_shard=1"]  # fmt: skip
    ring = run_app([*base, "parallelism.context.attention=auto"], tmp_path / "ring")
    gathered = run_app([*base, "parallelism.context.attention=allgather"], tmp_path / "allgather")
    assert "torch's ring attention" in ring["rank_layouts"][0]["context"]  # what runs: auto on CUDA is torch's ring
    assert "all-gather of K/V" in gathered["rank_layouts"][0]["context"]
    for a, b in zip(losses(ring), losses(gathered), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
