"""The mean of a tensor over a process group, sent in fp32, bf16 or int8: DiLoCo's pseudo-gradient exchange.

- ``fp32``: one all-reduce (sum, then / n): 4 bytes per element.
- ``bf16`` / ``int8``: a reduce-scatter made of an all-to-all of compressed chunks (rank j receives every rank's
  chunk j, decompresses them and averages them in fp32, in rank order), then an all-gather of the compressed chunk
  means. Each rank sends 2 (n - 1) / n of a payload, as a ring all-reduce does, so the wire bytes fall by the
  compression ratio at any replica count; no sum is taken in a narrow type (nothing overflows), and every rank
  decompresses the same gathered bytes, so every replica gets the same bits.

Rounding happens twice (each rank's chunk, then the chunk mean). bf16 keeps 8 significant bits: per element
``|err| <= 2**-8 x (mean_r |x_r| + |mean|)``. int8 (per block of :data:`INT8_BLOCK` elements, ``scale = absmax / 127``,
``q = round(x / scale)``, one fp32 scale per block): ``|err| <= max_r scale_r / 2 + scale_mean / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Elements per int8 quantization block (one fp32 scale each); compressed chunks are whole blocks.
INT8_BLOCK = 256


def payload_bytes(numel: int, compression: str) -> int:
    """Bytes of one compressed payload of ``numel`` elements."""
    if compression == "fp32":
        return 4 * numel
    if compression == "bf16":
        return 2 * numel
    return numel + 4 * math.ceil(numel / INT8_BLOCK)


def chunk_numel(numel: int, ranks: int) -> int:
    """Elements of each rank's chunk in a compressed exchange: ``numel / ranks`` rounded up to whole blocks."""
    return math.ceil(numel / (ranks * INT8_BLOCK)) * INT8_BLOCK


def exchange_sizes(numel: int, compression: str, ranks: int) -> list[tuple[str, int]]:
    """``(op, bytes)`` of each collective one exchange issues, in the telemetry's sizes (nccl-tests: an all-reduce's
    and an all-to-all's input, an all-gather's output)."""
    if compression == "fp32":
        return [("all_reduce", 4 * numel)]
    payload = payload_bytes(chunk_numel(numel, ranks), compression)
    return [("all_to_all", ranks * payload), ("all_gather", ranks * payload)]


def compress(x: Tensor, compression: str) -> Tensor:
    """The payload of the fp32 values ``x`` as int8 bytes (fp32: ``x`` itself; bf16: cast; int8: values + scales)."""
    if compression == "fp32":
        return x
    if compression == "bf16":
        return x.to(torch.bfloat16).view(torch.int8)
    return quantize_int8(x)


def decompress(payload: Tensor, numel: int, compression: str) -> Tensor:
    """The fp32 values of a :func:`compress` payload (up to its rounding)."""
    if compression == "int8":
        return dequantize_int8(payload, numel)
    if compression == "bf16" and payload.dtype == torch.int8:
        return payload.view(torch.bfloat16).float()
    return payload.float()


def quantize_int8(x: Tensor, block: int = INT8_BLOCK) -> Tensor:
    """Per-block absmax int8: ``numel`` int8 values, then one fp32 scale per block as 4 int8 bytes each."""
    flat = x.detach().float().reshape(-1)
    numel = flat.numel()
    blocks = math.ceil(numel / block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - numel)).view(blocks, block)
    scale = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale gives q = 0
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
    return torch.cat([q, scale.contiguous().view(torch.int8)])


def dequantize_int8(payload: Tensor, numel: int, block: int = INT8_BLOCK) -> Tensor:
    """fp32 values of a :func:`quantize_int8` payload of ``numel`` elements."""
    q, scale = payload[:numel].float(), payload[numel:].clone().view(torch.float32)  # clone: 4-byte aligned
    return q * scale.repeat_interleave(block)[:numel]


@dataclass
class Mean:
    """A mean over a group in flight: started by :func:`start_mean`, finished by :meth:`result`."""

    numel: int
    compression: str
    group: dist.ProcessGroup | None
    buffer: Tensor  # fp32: the sum (in place); compressed: every rank's payload of this rank's chunk
    work: Any = None  # the first collective's handle; None once waited for
    value: Tensor | None = None  # the mean, once finished

    def result(self) -> Tensor:
        """The fp32 mean (waits for the exchange; a compressed one runs its all-gather here, blocking)."""
        if self.value is not None:
            return self.value
        if self.work is not None:
            self.work.wait()
            self.work = None
        ranks = dist.get_world_size(self.group) if self.group is not None else 1
        if self.compression == "fp32":
            self.value = self.buffer / ranks
        else:
            chunk = chunk_numel(self.numel, ranks)
            rows = self.buffer.view(ranks, -1)
            total = decompress(rows[0], chunk, self.compression)
            for row in rows[1:]:  # rank order, in fp32: the same bits wherever this chunk is averaged
                total = total + decompress(row, chunk, self.compression)
            mine = compress(total / ranks, self.compression)
            gathered = mine.new_empty(ranks * mine.numel())
            if self.group is None:
                gathered = mine
            else:
                dist.all_gather_into_tensor(gathered, mine, group=self.group)
            parts = [decompress(row, chunk, self.compression) for row in gathered.view(ranks, -1)]
            self.value = torch.cat(parts)[: self.numel]
        self.buffer = self.value  # the payload buffers are no longer needed
        return self.value


def start_mean(x: Tensor, group: dist.ProcessGroup | None, compression: str) -> Mean:
    """Start the mean of the 1-D fp32 ``x`` over ``group`` (every rank the same length), sent as ``compression``."""
    numel = x.numel()
    if compression == "fp32":
        buffer = x.clone()
        work = dist.all_reduce(buffer, group=group, async_op=True) if group is not None else None
        return Mean(numel, compression, group, buffer, work)
    ranks = dist.get_world_size(group) if group is not None else 1
    chunk = chunk_numel(numel, ranks)
    padded = torch.nn.functional.pad(x, (0, ranks * chunk - numel))
    send = torch.cat([compress(part, compression) for part in padded.view(ranks, chunk)])
    if group is None:
        return Mean(numel, compression, group, send)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)
    return Mean(numel, compression, group, received, work)
