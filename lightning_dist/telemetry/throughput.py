"""Throughput arithmetic: tokens in a batch, FLOPs per token, the accelerator's peak, memory in use.

Kept free of Lightning so that it can be unit-tested without a Trainer.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch
import torch.distributed as dist

#: Dense (no sparsity) peak TFLOP/s per device from NVIDIA's datasheets: (bf16/fp16, tf32, fp32).
#: Matched against ``torch.cuda.get_device_name()``, most specific first.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100", (989.4, 494.7, 66.9)),  # SXM (the name reads "H100 80GB HBM3")
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a CUDA device for a Lightning ``precision`` string, ``None`` if not in the table.

    ``bf16*`` / ``16*`` precisions use the half-precision figure; ``32*`` uses TF32 when float32 matmuls may use
    it (``torch.set_float32_matmul_precision("high")``), else plain FP32.
    """
    for pattern, (half, tf32, fp32) in PEAK_TFLOPS:
        if pattern.lower() in device_name.lower():
            if "16" in str(precision):
                return half
            return tf32 if torch.get_float32_matmul_precision() != "highest" else fp32
    return None


def batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """``(samples, tokens)`` of one rank's batch: the first tensor found (the inputs), its dim 0 and numel.

    Accepts a tensor, a tuple / list ``(inputs, targets, ...)`` or a dict (``input_ids`` first, else any tensor).
    """
    tensor = _first_tensor(batch)
    if tensor is None:
        return 0, 0
    return (int(tensor.shape[0]) if tensor.ndim else 1), tensor.numel()


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def seq_len_of(batch: Any) -> int | None:
    tensor = _first_tensor(batch)
    return int(tensor.shape[-1]) if tensor is not None and tensor.ndim >= 2 else None


def find_flops_per_token(module: Any, seq_len: int | None) -> float | None:
    """Training FLOPs (forward + backward) per token: ``module.flops_per_token`` or ``module.model.flops_per_token``.

    The attribute may be a number or a method taking the sequence length (the reference GPT's is).
    """
    for owner in (module, getattr(module, "model", None)):
        value = getattr(owner, "flops_per_token", None) if owner is not None else None
        if value is None:
            continue
        if callable(value):
            return float(value(seq_len)) if seq_len is not None else None
        return float(value)
    return None


def parameter_count(module: torch.nn.Module, pp_group: Any = None) -> int:
    """Parameters of the whole model: a DTensor counts its global size, a pipeline stage's are summed over ``pp_group``.

    A weight shared by two stages (tied) is counted on both; the estimate it feeds is rough anyway.
    """
    count = sum(p.numel() for p in module.parameters())  # DTensor.numel() is the global size
    if pp_group is not None:
        total = torch.tensor([count], dtype=torch.float64, device="cpu")
        if dist.get_backend(pp_group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=pp_group)
        count = int(total.item())
    return count


def resident_memory_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; falls back to the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def model_state_bytes(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state: its own shards (DTensor local tensors),
    each tensor once (tied weights), what the planner's ``params`` / ``grads`` / ``optimizer`` predict."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    params = {id(p): p for p in module.parameters()}.values()
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        value
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    size = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors)  # noqa: E731
    return {"params": size(params), "grads": size(grads), "optimizer": size(states)}
