"""What one layout of a GPT training job costs per rank: memory, communication per axis, and step time.

Every number is analytic (no GPU is needed) and every assumption is a named constant or a hardware field, printed
with the plan (:data:`ASSUMPTIONS`). Memory is :mod:`lightning_dist.plan.memory` (Korthikanti et al. 2022 for
activations, the loss head included). Communication per step and rank uses the telemetry's definitions
(``comm/<axis>/bytes`` is nccl-tests' "size": the whole tensor of an all-gather / reduce-scatter / all-reduce, the
message of a send); time divides the bus bytes (size x nccl-tests' bus factor) by the link the axis runs on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_dist.config import HardwareConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.plan.memory import GIB, MemoryEstimate, _block_params, estimate_memory

PARAM_BYTES = 2  # bf16 parameters all-gathered by FSDP2 (bf16-mixed)
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduction (FSDP2 reduce_dtype, DDP buckets)
ACT_BYTES = 2  # bf16 activations sent by TP collectives and pipeline sends
FSDP_OVERLAP = 0.9  # fraction of the compute time FSDP2's prefetched all-gathers / reduce-scatters can hide under
DDP_OVERLAP = 0.9  # the same for the replicate all-reduce, under the backward (2/3 of the compute)
TP_OVERLAP = 0.8  # fraction of TP communication hidden where it is overlapped with the matmuls (not in our strategy)
RECOMPUTE = {"none": 1.0, "selective": 1.03, "full": 4 / 3}  # compute with activation recomputation (6N -> 8N full)
ASSUMPTIONS = [
    f"compute: the PaLM FLOPs per token (6N + 12 L H Q T) at hardware.compute_efficiency of peak; recomputation "
    f"multiplies it by {RECOMPUTE['selective']} (selective, element-wise ops) or {RECOMPUTE['full']:.2f} (full: one "
    "more forward)",
    f"FSDP2: bf16 parameters all-gathered in the forward and again in the backward of every micro batch (pipeline "
    f"stages: once per step, kept gathered: reshard_after_forward=False), fp32 gradients reduce-scattered once per "
    f"step; hidden under {FSDP_OVERLAP:.0%} of the compute, except one unit",
    f"replicas (DDP / HSDP): one fp32 all-reduce per step, hidden under {DDP_OVERLAP:.0%} of the backward",
    "TP with sequence parallelism: per block and micro batch 4 all-gathers and 4 reduce-scatters of the bf16 "
    f"activations (forward and backward), never hidden (our strategy does not overlap them; a layout with "
    f"tp_overlap, e.g. Megatron's, hides {TP_OVERLAP:.0%})",
    "PP: one bf16 activation send per microbatch forward and one gradient send per backward at each stage boundary, "
    "never hidden; bubble (p-1)/(v m + p - 1) of the step (v = stages per rank)",
    "links: tp inside a node; an axis whose groups span nodes runs at hardware.inter_node_gbps, else at "
    "intra_node_gbps (achievable bus bandwidth per device)",
]


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the degrees, the pipeline schedule, the micro batch and activation checkpointing."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int  # pipeline microbatches per step (pp > 1), else accumulated micro batches per step
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    ac: str = "none"
    tp_overlap: bool = False  # TP collectives overlapped with the matmuls (Megatron's --tp-comm-overlap, async TP)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    def describe(self) -> str:
        degrees = f"pp{self.pp} tp{self.tp} dp_replicate{self.dp_replicate} dp_shard{self.dp_shard}"
        pipe = f" {self.schedule} v{self.stages_per_rank}" if self.pp > 1 else ""
        return f"{degrees}{pipe} m{self.microbatches} mb{self.micro_batch} ac={self.ac}"


@dataclass
class Estimate:
    """The cost of one :class:`Layout` for the worst rank."""

    layout: Layout
    memory: MemoryEstimate
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # axis -> bytes, calls, seconds, exposed_s
    compute_s: float = 0.0
    bubble_fraction: float = 0.0
    step_s: float = 0.0
    tokens_per_sec_per_device: float = 0.0
    mfu: float = 0.0
    fits: bool = False

    def to_json(self) -> dict[str, Any]:
        """The plan's JSON object for this layout."""
        return {
            "layout": asdict(self.layout),
            "memory_gib": round(self.memory.total / GIB, 2),
            "memory_parts_gib": self.memory.gib(),
            "comm_bytes": {axis: int(c["bytes"]) for axis, c in self.comm.items()},
            "comm_exposed_s": {axis: round(c["exposed_s"], 4) for axis, c in self.comm.items()},
            "compute_s": round(self.compute_s, 4),
            "bubble_fraction": round(self.bubble_fraction, 4),
            "step_s": round(self.step_s, 4),
            "tokens_per_sec_per_device": round(self.tokens_per_sec_per_device, 1),
            "mfu": round(self.mfu, 4),
            "fits": self.fits,
        }


def stage_params(cfg: GPTConfig, pp: int, stages_per_rank: int = 1) -> int:
    """Parameters of the pipeline rank holding the most (the whole model for ``pp=1``); see :func:`rank_params`."""
    return max(rank_params(cfg, pp, stages_per_rank))


def rank_params(cfg: GPTConfig, pp: int, stages_per_rank: int = 1) -> list[int]:
    """Parameters of each pipeline rank, split as the strategy splits: blocks balanced by parameter count with the
    embedding on the first and the final norm and head on the last
    (:func:`lightning_dist.parallel.pipeline.balanced_split`), rank r holding stages r, r + pp, ..."""
    from lightning_dist.parallel.pipeline import balanced_split

    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings and pp == 1 else cfg.vocab_size * cfg.d_model
    costs = [float(_block_params(cfg))] * cfg.n_layers
    costs[0] += embedding
    costs[-1] += head + cfg.d_model
    if pp == 1:
        return [int(sum(costs))]
    groups = balanced_split(costs, pp * stages_per_rank)
    return [int(sum(costs[i] for stage in groups[r::pp] for i in stage)) for r in range(pp)]


def estimate(cfg: GPTConfig, layout: Layout, hw: HardwareConfig, seq_len: int, global_batch: int) -> Estimate:
    """Memory, communication, step time, tokens/s and MFU of ``layout`` for the model ``cfg``.

    Args:
        cfg: The model.
        layout: The layout.
        hw: The device and its links.
        seq_len: Tokens per sample.
        global_batch: Samples per optimizer step, over all data-parallel ranks.
    """
    lay = layout
    dp = lay.dp_replicate * lay.dp_shard
    local = stage_params(cfg, lay.pp, lay.stages_per_rank) // (lay.tp * lay.dp_shard)
    memory = estimate_memory(
        cfg, local_params=local, seq_len=seq_len, micro_batch=lay.micro_batch, tp=lay.tp, dp_shard=lay.dp_shard,
        pp=lay.pp, microbatches=lay.microbatches if lay.pp > 1 else 1, schedule=lay.schedule,
        activation_checkpointing=lay.ac,
    )  # fmt: skip
    flops_per_token = flops_per_token_of(cfg, seq_len)
    tokens = global_batch * seq_len
    compute_s = (
        flops_per_token * tokens / lay.world * RECOMPUTE[lay.ac] / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
    )

    comm: dict[str, dict[str, float]] = {}
    stage = (
        stage_params(cfg, lay.pp, lay.stages_per_rank) / lay.tp
    )  # what FSDP2 gathers and reduces: tp-sharded, whole over dp_shard
    steps = lay.microbatches  # micro batches per optimizer step, pipelined or accumulated
    blocks = math.ceil(cfg.n_layers / lay.pp)
    if lay.dp_shard > 1 and lay.pp > 1:  # stages keep their gathered parameters for the whole schedule
        memory = replace(memory, buffers=memory.buffers + int(stage * PARAM_BYTES))
    if lay.dp_shard > 1:
        gather = (2 * steps if lay.pp == 1 else 1) * stage * PARAM_BYTES
        reduce = stage * GRAD_REDUCE_BYTES
        bus = (gather + reduce) * (lay.dp_shard - 1) / lay.dp_shard
        seconds = bus / _link(hw, lay.tp * lay.dp_shard) / 1e9
        exposed = max(seconds - FSDP_OVERLAP * compute_s, seconds / (blocks + 1))
        calls = ((2 * steps if lay.pp == 1 else 1) + 1) * (blocks + 1)
        comm["dp_shard"] = {"bytes": gather + reduce, "calls": calls, "seconds": seconds,
                            "exposed_s": exposed}  # fmt: skip
    if lay.dp_replicate > 1:
        size = stage / lay.dp_shard * GRAD_REDUCE_BYTES
        seconds = size * 2 * (lay.dp_replicate - 1) / lay.dp_replicate / _link(hw, dp * lay.tp) / 1e9
        exposed = max(0.0, seconds - DDP_OVERLAP * compute_s * 2 / 3)
        comm["dp_replicate"] = {"bytes": size, "calls": max(1, math.ceil(size / 25e6)), "seconds": seconds,
                                "exposed_s": exposed}  # fmt: skip
    if lay.tp > 1:
        message = lay.micro_batch * seq_len * cfg.d_model * ACT_BYTES
        size = 8 * blocks * steps * message
        seconds = size * (lay.tp - 1) / lay.tp / hw.intra_node_gbps / 1e9
        exposed = seconds * (1 - TP_OVERLAP) if lay.tp_overlap else seconds
        comm["tp"] = {"bytes": size, "calls": 8 * blocks * steps, "seconds": seconds, "exposed_s": exposed}
    bubble = 0.0
    if lay.pp > 1:
        message = lay.micro_batch * seq_len * cfg.d_model * ACT_BYTES
        size = 2 * steps * message  # a middle stage: activations forward, gradients backward
        apart = lay.world // lay.pp  # ranks between neighbouring stages (pp is the outermost axis)
        seconds = size / (hw.inter_node_gbps if apart >= hw.gpus_per_node else hw.intra_node_gbps) / 1e9
        comm["pp"] = {"bytes": size, "calls": 2 * steps, "seconds": seconds, "exposed_s": seconds}
        v = lay.stages_per_rank
        bubble = (lay.pp - 1) / (v * lay.microbatches + lay.pp - 1)
    exposed = sum(c["exposed_s"] for c in comm.values())
    step_s = (compute_s + exposed) / (1 - bubble)
    per_device = tokens / step_s / lay.world
    return Estimate(
        layout=lay,
        memory=memory,
        comm=comm,
        compute_s=compute_s,
        bubble_fraction=bubble,
        step_s=step_s,
        tokens_per_sec_per_device=per_device,
        mfu=flops_per_token * per_device / (hw.peak_tflops * 1e12),
        fits=memory.fits(hw.memory_gib, hw.context_gib),
    )


def _link(hw: HardwareConfig, span: int) -> float:
    """Bus bandwidth (GB/s per device) of a group whose ranks spread over ``span`` consecutive ranks."""
    return hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps


def flops_per_token_of(cfg: GPTConfig, seq_len: int) -> float:
    """``GPT.flops_per_token`` from the config alone: 6 x non-embedding parameters + 12 L H Q T."""
    non_embedding = cfg.n_layers * _block_params(cfg) + cfg.d_model + cfg.vocab_size * cfg.d_model  # + norm, head
    if cfg.arch == "gpt2":
        non_embedding += cfg.d_model  # the final LayerNorm's bias
    return 6 * non_embedding + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
