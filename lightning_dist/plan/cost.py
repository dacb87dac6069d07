"""What one layout of a GPT training job costs per rank: memory, communication per axis, and step time.

Every number is analytic (no GPU is needed) and every assumption is a named constant or a hardware field, printed
with the plan (:data:`ASSUMPTIONS`). Memory is :mod:`lightning_dist.plan.memory` (Korthikanti et al. 2022 for
activations, the loss head included). Communication per step and rank uses the telemetry's definitions
(``comm/<axis>/bytes`` is nccl-tests' "size": the whole tensor of an all-gather / reduce-scatter / all-reduce, the
message of a send); time divides the bus bytes (size x nccl-tests' bus factor) by the link the axis runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_dist.config.schema import HardwareConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.compression import payload_bytes
from lightning_dist.parallel.pipeline import stage_ids
from lightning_dist.parallel_dims import AXES, DP_CP, DP_SHARD_CP, EFSDP, EFSDP_CP, EP
from lightning_dist.plan.collectives import Dtypes, fragment_elements, outer_collectives, step_collectives
from lightning_dist.plan.experts import expert_collectives, gathered_stage_params, local_params
from lightning_dist.plan.layout import Layout, layer_params, stage_split
from lightning_dist.plan.memory import GIB, MemoryEstimate, block_linear_params, block_params, estimate_memory
from lightning_dist.plan.moe_memory import active_block_params
from lightning_dist.telemetry.comm import BUS_FACTORS

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
FSDP_OVERLAP = 0.9  # fraction of the compute time FSDP2's prefetched all-gathers / reduce-scatters can hide under
DDP_OVERLAP = 0.9  # the same for the replicate all-reduce, under the backward (2/3 of the compute)
TP_OVERLAP = 0.8  # fraction of TP communication hidden where it is overlapped with the matmuls (not in our strategy)
RECOMPUTE = {"none": 1.0, "selective": 1.03, "full": 4 / 3}  # compute with activation recomputation (6N -> 8N full)
#: The device memory bandwidth (TB/s) compute_efficiency is stated at: the H100 SXM's HBM3 (datasheet 3.35 TB/s).
REFERENCE_MEMORY_TBPS = 3.35
#: Share of a step at the reference bandwidth spent in memory-bound (element-wise, unfused) kernels, which scales
#: with the device's bandwidth. From torchtitan's Llama 3.1 8B FSDP runs on 2.4 TB/s HBM2e H100s: torch.compile's
#: fusion took 13.6% (8 GPUs: 5,762 -> 6,667 tokens/s) and 14.0% (128 GPUs) off the eager step, 0.138 there, 0.103
#: once that share runs at 3.35 TB/s (0.138 x 2.4/3.35 of a step of 1 - 0.138 + 0.138 x 2.4/3.35).
MEMORY_BOUND_SHARE = 0.103
#: Bytes moved per element float8 casts (bf16 read for the amax, read again, float8 written).
FLOAT8_CAST_BYTES = 5
#: Host memory traffic per rank (GB/s) of DiLoCo's outer step: pageable copies of the fp32 backup over PCIe and
#: the CPU's Nesterov SGD on it (parallel/diloco.py keeps both on the host). A stated guess, not a measurement.
HOST_GBPS = 20.0
#: Host bytes per parameter element of an outer step: the backup copied to the device (4), the average back (4), the
#: result to the device (4), and the SGD reading backup, gradient, momentum (12) and writing backup, momentum (8).
HOST_BYTES_PER_ELEMENT = 32
#: Host bytes per parameter element of AdamW's step on the CPU (cpu_offload): parameter, gradient and both moments
#: read (16), parameter and moments written (12).
ADAMW_HOST_BYTES = 28
#: Host-device copies per rank (GB/s) under cpu_offload: PCIe Gen5 x16 with pinned memory, about half its 64 GB/s
#: (a stated guess, not a measurement).
PCIE_GBPS = 25.0
ASSUMPTIONS = [
    f"compute: the PaLM FLOPs per token (6N + 12 L H Q T) at hardware.compute_efficiency of peak; recomputation "
    f"multiplies it by {RECOMPUTE['selective']} (selective op: element-wise ops; op_half adds the forward of every "
    f"second matmul, from the shapes) or {RECOMPUTE['full']:.2f} (full: one "
    "more forward)",
    "communication: every collective a rank issues per step, counted from the model's shapes "
    "(lightning_dist.plan.collectives: FSDP2 gathers / reductions per unit, TP sequence all-gathers / "
    "reduce-scatters per block and micro batch, recomputed ones under activation checkpointing, pipeline sends, "
    "gradient-norm and loop scalars); equal to what the telemetry measures on CPU runs",
    f"FSDP2 all-gathers and reduce-scatters hidden under {FSDP_OVERLAP:.0%} of the compute, except one unit's; "
    f"replica all-reduces under {DDP_OVERLAP:.0%} of the backward",
    f"TP and PP communication never hidden (our strategy does not overlap them; a layout with tp_overlap, e.g. "
    f"Megatron's, hides {TP_OVERLAP:.0%} of TP)",
    "pipeline bubble (p-1)/(v m + p-1) of the step (v = stages per rank); zero-bubble schedules (InterleavedZeroBubble,"
    " ZBVZeroBubble, DualPipeV) leave a third of that idle time",
    "context parallelism: per block and micro batch an all-gather of the keys and values of the whole sequence in "
    "the forward (again when recomputed) and a reduce-scatter of their gradients, never hidden; attention compute "
    "split evenly over cp (head-tail chunks)",
    "expert parallelism: per MoE block and micro batch the all-to-alls of the routed rows (and their gradients), "
    "never hidden, with balanced routing (a rank receives what it sends); experts whole on every tp rank, 1 / ep "
    "on each ep rank, FSDP2-sharded over the rest of dp_shard x cp",
    "links: tp inside a node; an axis whose groups span nodes runs at hardware.inter_node_gbps, else at "
    "intra_node_gbps (achievable bus bandwidth per device)",
    f"memory bandwidth: {MEMORY_BOUND_SHARE:.1%} of the compute time at {REFERENCE_MEMORY_TBPS} TB/s is memory-bound "
    "and scales with hardware.memory_tbps (torchtitan's eager vs compiled 8B steps)",
    "DiLoCo: no replica traffic in inner steps; every H steps each fragment's pseudo-gradient crosses dp_replicate "
    "(fp32 all-reduce; bf16 / int8 an all-to-all of compressed chunks, then an all-gather of the chunk means: "
    "2 (n-1)/n payloads per rank), shown per step as the cycle's bytes / H; "
    f"exposed unless delayed (tau > 0: hidden under tau inner steps), plus host work at {HOST_GBPS:g} GB/s "
    f"({HOST_BYTES_PER_ELEMENT} bytes per element: backup copies and the CPU's outer SGD)",
    "float8 (parallelism.float8): the blocks' linear matmuls (forward and both backward ones) at "
    "hardware.float8_tflops (2x the bf16 peak by default), the rest at the bf16 peak; the casts of their inputs "
    "(twice) and output gradients at hardware.memory_tbps, 5 bytes per element (torchao's amax all-reduces not "
    "counted; torchtitan measures 1.2-1.5x on H100s); tensorwise gathers the converted weights in float8 (1 byte); "
    "activations unchanged (torchao saves high-precision inputs)",
    f"cpu_offload: states in host memory; each all-gather copies the unit's fp32 shard to the device and each "
    f"gradient shard comes back at {PCIE_GBPS:g} GB/s, AdamW on the host ({ADAMW_HOST_BYTES} bytes per element at "
    f"{HOST_GBPS:g} GB/s), never hidden",
    "loss_chunks=n: one piece of 1/n of the tokens holds logits at a time (10 bytes per logit, recomputed in the "
    "backward: one more head matmul per token, 2 V d FLOPs, counted)",
]


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
            "layout": self.layout.to_json(),
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


def stage_params(cfg: GPTConfig, pp: int, stages_per_rank: int = 1, schedule: str = "1F1B") -> int:
    """Parameters of the pipeline rank holding the most (the whole model for ``pp=1``); see :func:`rank_params`."""
    return max(rank_params(cfg, pp, stages_per_rank, schedule))


def rank_params(cfg: GPTConfig, pp: int, stages_per_rank: int = 1, schedule: str = "1F1B") -> list[int]:
    """Parameters of each pipeline rank, split as the strategy splits (:func:`lightning_dist.plan.layout.stage_split`),
    rank r holding stages r, r + pp, ... (a V for ZBV / DualPipeV)."""
    costs = layer_params(cfg, pp)
    if pp == 1:
        return [int(sum(costs))]
    groups = stage_split(cfg, pp * stages_per_rank)
    return [
        int(sum(costs[i] for s in stage_ids(r, pp, stages_per_rank, schedule) for i in groups[s])) for r in range(pp)
    ]


def estimate(
    cfg: GPTConfig, layout: Layout, hw: HardwareConfig, seq_len: int, global_batch: int, precision: str = "bf16-mixed"
) -> Estimate:
    """Memory, communication, step time, tokens/s and MFU of ``layout`` for the model ``cfg``.

    Args:
        cfg: The model.
        layout: The layout.
        hw: The device and its links.
        seq_len: Tokens per sample.
        global_batch: Samples per optimizer step, over all data-parallel ranks.
        precision: Lightning's precision string (the dtypes of gathers, reductions and activations).
    """
    lay = layout
    memory = _memory(cfg, lay, seq_len, precision)
    flops_per_token = flops_per_token_of(cfg, seq_len)
    tokens = global_batch * seq_len
    compute_s = _compute_seconds(cfg, lay, hw, seq_len, tokens)
    comm = _communication(cfg, lay, hw, seq_len, precision, compute_s)
    bubble = bubble_fraction(lay) if lay.pp > 1 else 0.0
    exposed = sum(c["exposed_s"] for c in comm.values())
    step_s = (compute_s + exposed) / (1 - bubble)
    if lay.options.fsdp.cpu_offload:  # the host's part of the step, never hidden (torch's AdamW on the CPU)
        step_s += offload_seconds(lay, memory.params // 4, math.ceil(cfg.n_layers / lay.pp))
    if lay.diloco:  # after the inner step, outside its bubble
        step_s += _outer_sync(cfg, lay, hw, comm, step_s)
        memory = replace(memory, outer_sync=_outer_sync_bytes(cfg, lay))
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


def _memory(cfg: GPTConfig, lay: Layout, seq_len: int, precision: str) -> MemoryEstimate:
    """A rank's memory (:func:`estimate_memory`), with a pipeline stage's parameters kept gathered under FSDP2."""
    if cfg.moe.enabled:  # dense parameters and routed experts are laid out apart
        local = local_params(cfg, lay)
    else:
        local = stage_params(cfg, lay.pp, lay.stages_per_rank, lay.schedule) // (lay.tp * lay.fsdp_shard)
    memory = estimate_memory(
        cfg, lay.dims, lay.options, local_params=local, seq_len=seq_len, micro_batch=lay.micro_batch
    )
    if lay.dp_shard > 1 and lay.pp > 1:  # stages keep their gathered parameters for the whole schedule
        whole = stage_params(cfg, lay.pp, lay.stages_per_rank, lay.schedule) / lay.tp  # MoE: experts 1 / ep, whole
        gathered = (gathered_stage_params(cfg, lay) if cfg.moe.enabled else whole) * Dtypes.of(precision).compute
        memory = replace(memory, buffers=memory.buffers + int(gathered))
    return memory


def _compute_seconds(cfg: GPTConfig, lay: Layout, hw: HardwareConfig, seq_len: int, tokens: int) -> float:
    """Seconds of a step's matmuls on one device (recomputation and float8 included), and float8's casts."""
    return (
        flops_per_token_of(cfg, seq_len)
        * tokens
        / lay.world
        * recompute_factor(cfg, lay, seq_len)
        * precision_factor(cfg, lay, hw, seq_len)
        / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
        * memory_factor(hw)
    ) + float8_cast_bytes(cfg, lay) * tokens / lay.world / (hw.memory_tbps * 1e12)


def _communication(
    cfg: GPTConfig, lay: Layout, hw: HardwareConfig, seq_len: int, precision: str, compute_s: float
) -> dict[str, dict[str, float]]:
    """Per axis: the step's bytes, calls, seconds on its link and the seconds not hidden under compute."""
    collectives = step_collectives(cfg, lay, seq_len, precision, ddp=lay.ddp)
    collectives += expert_collectives(cfg, lay, seq_len, precision)  # ep's all-to-alls, never hidden
    comm: dict[str, dict[str, float]] = {}
    links: dict[str, tuple[int, float]] = {}  # axis -> (group size, bus bandwidth), worked out once per axis
    for c in collectives:
        axis = comm.setdefault(c.axis, {"bytes": 0, "calls": 0, "seconds": 0.0})
        if c.axis not in links:
            links[c.axis] = (_group_size(lay, c.axis), _axis_link(hw, lay, c.axis))
        group, link = links[c.axis]
        axis["bytes"] += c.bytes
        axis["calls"] += c.calls
        axis["seconds"] += c.bytes * BUS_FACTORS[c.op](group) / link / 1e9
    blocks = math.ceil(cfg.n_layers / lay.pp)
    for name, axis in comm.items():
        seconds = axis["seconds"]
        # prefetched: hidden under compute except the first unit's
        if name in ("dp_shard", DP_SHARD_CP, EFSDP, EFSDP_CP):
            axis["exposed_s"] = max(seconds - FSDP_OVERLAP * compute_s, seconds / (blocks + 1))
        elif name == "dp_replicate":  # under the backward
            axis["exposed_s"] = max(0.0, seconds - DDP_OVERLAP * compute_s * 2 / 3)
        elif name == "tp" and lay.tp_overlap:
            axis["exposed_s"] = seconds * (1 - TP_OVERLAP)
        else:
            axis["exposed_s"] = seconds
    return comm


def offload_seconds(lay: Layout, local: int, blocks: int) -> float:
    """Seconds a step spends on ``parallelism.fsdp.cpu_offload``: every all-gather of a unit first copies its fp32 shard
    to the device, each gradient shard comes back, at :data:`PCIE_GBPS`; AdamW runs on the host,
    :data:`ADAMW_HOST_BYTES` per element at :data:`HOST_GBPS`. ``local``: the rank's parameter elements."""
    gathers = 1 if lay.pp > 1 else 2 * lay.microbatches * blocks / (blocks + 1)  # the last unit and root: once
    copies = local * 4 * (gathers + 1) / (PCIE_GBPS * 1e9)
    return copies + local * ADAMW_HOST_BYTES / (HOST_GBPS * 1e9)


def memory_factor(hw: HardwareConfig) -> float:
    """Compute time on ``hw``'s memory over that at the reference bandwidth (:data:`MEMORY_BOUND_SHARE`)."""
    tbps = hw.memory_tbps
    return 1 - MEMORY_BOUND_SHARE + MEMORY_BOUND_SHARE * REFERENCE_MEMORY_TBPS / tbps


def _outer_sync(
    cfg: GPTConfig, lay: Layout, hw: HardwareConfig, comm: dict[str, dict[str, float]], inner_s: float
) -> float:
    """Add DiLoCo's outer sync to ``comm["dp_replicate"]`` as a per-step average; its exposed seconds per step.

    Each fragment's exchange blocks (tau = 0) or overlaps tau inner steps of ``inner_s`` (the link otherwise idle);
    the host work (backup copies, the outer SGD) is never hidden: parallel/diloco.py runs it in the step.
    """
    opts = lay.options.diloco
    every, link = opts.every, _axis_link(hw, lay, "dp_replicate")
    outer = outer_collectives(cfg, lay)
    wire = [c.bytes * BUS_FACTORS[c.op](lay.dp_replicate) / link / 1e9 for c in outer]
    # The delay overlaps the exchange's first collective; a compressed one's all-gather of the chunk means runs when
    # the result is applied (parallel/compression.py), exposed.
    hidden = [0.0 if c.op == "all_gather" else opts.delay * inner_s for c in outer]
    exposed = sum(max(0.0, t - h) for t, h in zip(wire, hidden))
    host = sum(fragment_elements(cfg, lay)) * HOST_BYTES_PER_ELEMENT / HOST_GBPS / 1e9
    axis = comm.setdefault("dp_replicate", {"bytes": 0, "calls": 0, "seconds": 0.0, "exposed_s": 0.0})
    axis["bytes"] += sum(c.bytes for c in outer_collectives(cfg, lay)) / every
    axis["calls"] += opts.fragments / every
    axis["seconds"] += sum(wire) / every
    axis["exposed_s"] += (exposed + host) / every
    axis["host_s"] = host / every
    return (exposed + host) / every


def _outer_sync_bytes(cfg: GPTConfig, lay: Layout) -> int:
    """Device bytes of the largest fragment's exchange (parallel/diloco.py): the fp32 pseudo-gradient and its fp32
    average; compressed, also the padded copy, the payloads sent, received and gathered, and the decompressed rows."""
    numel = max(fragment_elements(cfg, lay))
    compression = lay.options.diloco.compression
    if compression == "fp32":
        return 8 * numel
    return 16 * numel + 3 * payload_bytes(numel, compression)


def recompute_factor(cfg: GPTConfig, layout: Layout, seq_len: int) -> float:
    """Compute of a step with activation recomputation over one without: ``op_half`` adds the forward of every
    second matmul (k, o, up of a Llama block) to ``op``'s element-wise ops."""
    factor = RECOMPUTE[layout.ac]
    if layout.ac == "selective" and layout.ac_selective == "op_half":
        h, hd = cfg.d_model, cfg.head_dim
        again = 2 * cfg.n_layers * (h * cfg.kv_heads * hd + cfg.n_heads * hd * h + h * cfg.hidden_dim)
        factor += again / flops_per_token_of(cfg, seq_len)
    return factor


def precision_factor(cfg: GPTConfig, layout: Layout, hw: HardwareConfig, seq_len: int) -> float:
    """Compute time of a step over its bf16 time: float8 runs the blocks' linear matmuls (6 FLOPs per weight and
    token) at ``hw.float8_tflops``; ``loss_chunks`` adds the head's forward again in the backward (2 V d per token).

    Raises:
        ValueError: float8 on a device without float8 matmuls (``hw.float8_tflops=0``: torchao would emulate them).
    """
    flops = flops_per_token_of(cfg, seq_len)
    factor = 1.0
    if layout.options.float8 != "off":
        float8_tflops = hw.float8_tflops if hw.float8_tflops is not None else 2 * hw.peak_tflops
        if float8_tflops <= 0:
            raise ValueError(
                f"parallelism.float8={layout.options.float8} on {hw.name}, which has no float8 matmuls (torchao would "
                "emulate them, slower than bf16); set parallelism.float8=off or pick a float8 GPU (hardware=h100_sxm)."
            )
        linear = 6 * _float8_linears(cfg)
        factor -= linear / flops * (1 - hw.peak_tflops / float8_tflops)
    if layout.options.loss_chunks:
        factor += 2 * cfg.vocab_size * cfg.d_model / flops
    return factor


def float8_cast_bytes(cfg: GPTConfig, layout: Layout) -> float:
    """Device memory traffic per token (all blocks) of float8's casts, :data:`FLOAT8_CAST_BYTES` per element cast:
    each converted matmul's input in the forward and again in the backward (torchao saves it in high precision) and
    its output gradient; memory-bound kernels, at ``hw.memory_tbps``. 0 without float8."""
    if layout.options.float8 == "off":
        return 0.0
    h, hd, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.kv_heads * cfg.head_dim
    total = 0
    for f in (_float8_width(cfg, i) for i in range(cfg.n_layers)):
        mlp = 2 if f else 0  # gate and up (none in an MoE block without shared experts)
        inputs = (
            (3 + mlp) * h + hd + f
        )  # q, k, v, gate, up read the block's normed stream; o the attention; down the MLP
        grads = hd + kv + h + (h + 2 * f if f else 0)  # the output gradients of q, k + v, o and down, gate and up
        total += 2 * inputs + grads
    return FLOAT8_CAST_BYTES * total


def _float8_width(cfg: GPTConfig, index: int) -> int:
    """The hidden width of block ``index``'s float8 MLP: the dense MLP's, or in an MoE block the shared experts'
    (the routed experts are grouped weights, not ``nn.Linear``: float8 leaves them in bf16)."""
    return cfg.moe.shared_experts * cfg.expert_hidden if cfg.is_moe_layer(index) else cfg.hidden_dim


def _float8_linears(cfg: GPTConfig) -> int:
    """Weights float8 converts, over all blocks (:func:`_float8_width`)."""
    return sum(block_linear_params(replace(cfg, ffn_hidden=_float8_width(cfg, i))) for i in range(cfg.n_layers))


def bubble_fraction(layout: Layout) -> float:
    """Idle fraction of a pipeline step: ``(p-1)/(v m + p-1)`` for GPipe / 1F1B (v = 1) and the interleaved
    schedules; a third of that idle time for the zero-bubble schedules, which fill it with weight gradients (Qi et
    al. 2023, equal forward, input-gradient and weight-gradient times)."""
    p, v, m = layout.pp, layout.stages_per_rank, layout.microbatches
    idle = (p - 1) / 3 if layout.schedule in ZERO_BUBBLE else p - 1
    return idle / (v * m + idle)


def _group_size(layout: Layout, axis: str) -> int:
    """Ranks in a group of ``axis``: its degree, the world for the default group, 2 for any other (a tied pair)."""
    if axis == DP_SHARD_CP:
        return layout.fsdp_shard
    if axis in (EP, EFSDP, EFSDP_CP):  # the experts' axes (EFSDP_CP: the ranks holding the same experts)
        return {EP: layout.ep, EFSDP: layout.dp_shard // layout.ep, EFSDP_CP: layout.fsdp_shard // layout.ep}[axis]
    if axis == DP_CP:
        return layout.dims.dp_cp_size
    return layout.dims.degrees.get(axis, layout.world if axis == "world" else 2)


def _axis_link(hw: HardwareConfig, layout: Layout, axis: str) -> float:
    """Bus bandwidth of an axis: the mesh is row-major over ``AXES`` (pp outermost, tp innermost)."""
    if axis == "pp":  # stages are contiguous blocks of ranks: once the world spans nodes, some hop crosses one, and
        # a pipeline runs at its slowest hop
        return hw.inter_node_gbps if layout.world > hw.gpus_per_node else hw.intra_node_gbps
    return _link(hw, _span(layout, axis))


def _span(layout: Layout, axis: str) -> int:
    """Consecutive ranks a group of ``axis`` spreads over: its degree times those of the axes inside it; the whole
    world for a group that is no mesh axis."""
    degrees = layout.dims.degrees
    if axis in (DP_SHARD_CP, EFSDP, EFSDP_CP):  # dp_shard x cp, adjacent on the mesh (efsdp: dp_shard's outer part)
        return math.prod(degrees[inner] for inner in AXES[AXES.index("dp_shard") :])
    if axis == EP:  # (pp, dp_replicate, efsdp, cp, ep, tp): an ep group holds neighbouring tp groups
        return layout.ep * layout.tp
    if axis not in AXES:
        return layout.world
    return math.prod(degrees[inner] for inner in AXES[AXES.index(axis) :])


def _link(hw: HardwareConfig, span: int) -> float:
    """Bus bandwidth (GB/s per device) of a group whose ranks spread over ``span`` consecutive ranks."""
    return hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps


def flops_per_token_of(cfg: GPTConfig, seq_len: int) -> float:
    """``GPT.flops_per_token`` from the config alone: 6 x the non-embedding parameters a token passes through (of an
    MoE block, its ``top_k`` routed experts) + 12 L H Q T."""
    blocks = sum(active_block_params(cfg, i, block_params(cfg)) for i in range(cfg.n_layers))
    non_embedding = blocks + cfg.d_model + cfg.vocab_size * cfg.d_model  # + norm, head
    if cfg.arch == "gpt2":
        non_embedding += cfg.d_model  # the final LayerNorm's bias
    return 6 * non_embedding + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
