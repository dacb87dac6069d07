"""The ``parallelism`` group's schema: the layout's degrees and how each axis works (``ParallelOptions`` fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DiLoCoConfig:
    """``parallelism.sync=diloco``: DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) on the
    ``dp_replicate`` axis (lightning_dist/parallel/diloco.py)."""

    every: int = 50
    """H: inner optimizer steps per outer step (per fragment)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """Outer SGD momentum (0 = none)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""
    fragments: int = 1
    """Streaming: F contiguous groups of blocks, each synchronized H/F steps after the previous (1 = plain DiLoCo)."""
    delay: int = 0
    """Streaming: tau, inner steps a fragment's all-reduce overlaps before it is applied (0 = blocking)."""
    alpha: float = 0.0
    """Streaming: mixing factor; new = (1 - alpha) x outer result + alpha x local parameters."""
    compression: str = "fp32"
    """The pseudo-gradient exchange: fp32, bf16 or int8 (per-block absmax scale, one fp32 scale per 256 values)."""


@dataclass
class ParallelismConfig:
    """How the job is laid out over devices; degrees follow :class:`~lightning_dist.ParallelDims`."""

    strategy: str = "ddp"
    """Strategy name: ddp (Lightning's DDP) or a mesh layout (fsdp, tensor_parallel, pipeline_parallel: our
    MeshStrategy). fsdp is FSDP2 (torch fully_shard), not Lightning's strategy="fsdp" (FSDP1)."""
    dp_replicate: int = 1
    """Data-parallel replicas (gradients all-reduced); -1 = the rest of the world size."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2, parameters sharded); -1 = the rest of the world size."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, head-tail balanced (data.seq_len divisible by
    2 x cp; the built-in GPT, arch=llama)."""
    ep: int = 1
    """Expert-parallel degree: each MoE block's experts split over ep of the dp_shard ranks (ep divides dp_shard and
    the number of experts), tokens sent to their experts and back by all-to-all; the experts FSDP2-sharded over the
    rest of dp_shard (and cp). Models with MoE blocks (model.moe.num_experts > 0, model=hf Mixtral / Qwen-MoE /
    OLMoE)."""
    cp_attention: str = "auto"
    """Context parallel: the attention across the cp group: auto (torch on CUDA, else allgather), allgather (all-gather
    of keys and values, the causal mask offset by each chunk's position; any device and backend, exact) or torch
    (torch's ring attention on CUDA's flash / efficient / cuDNN SDPA kernels). The start-up layout says which runs."""
    cp_rotate: str = "allgather"
    """Context parallel, torch's ring attention: keys and values travel by one allgather or by alltoall (cp - 1 ring
    steps, each overlapping a block of attention); torch's set_rotate_method."""
    tp_plan: str | None = None
    """Tensor parallel: the plan to shard with instead of the model's own: a YAML / JSON file mapping module-name
    patterns (relative to the LightningModule, e.g. model.model.layers.*.self_attn.q_proj) to styles (colwise,
    rowwise, sequence, colwise_gather_output, rowwise_split_input, embedding_rowwise,
    replicated_with_grad_allreduce), or package.module:name of such a dict (or of a function returning one)."""
    sequence_parallel: bool = True
    """Tensor parallel: shard norms and residuals along the sequence dim."""
    loss_parallel: bool = True
    """Tensor parallel: compute the cross-entropy on vocab-sharded logits (no all-gather of logits)."""
    schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble."""
    microbatches: int | None = None
    """Pipeline microbatches per step; None = pp x stages_per_rank."""
    stages_per_rank: int = 1
    """Pipeline: virtual stages per rank (2 or more for interleaved / looped schedules)."""
    split_points: list[str] | None = None
    """Pipeline: module names that start a new stage (e.g. [layers.2]); None = balanced automatic split."""
    activation_checkpointing: str = "none"
    """none, full (every block recomputed in backward) or selective (see ac_selective); whole models and stages."""
    ac_selective: str = "op"
    """selective: op (keep matmul / attention outputs, recompute the rest), op_half (also recompute every second
    matmul: torchtitan's policy) or n (every n-th block fully)."""
    compile: bool = False
    """torch.compile each block (after TP and activation checkpointing, before FSDP2); needs a C++ compiler on CPU."""
    cpu_offload: bool = False
    """FSDP2 keeps parameter shards, gradients and optimizer state in host memory; needs dp_shard or dp_replicate>1."""
    sync: str = "every_step"
    """How replicas (dp_replicate) stay together: every_step (gradients all-reduced, DDP / HSDP) or diloco (each
    replica trains alone and an outer step averages their progress every diloco.every steps)."""
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """sync=diloco: the outer step's period, optimizer, fragments and compression."""
    ddp_comm_hook: str | None = None
    """parallelism=ddp: compress the gradient all-reduce with torch's DDP hook: bf16, fp16 or powersgd (rank 1, error
    feedback, after 1000 plain steps); null = full precision. Not exact: the sums are rounded."""
    reduce_dtype: str | None = None
    """FSDP2 layouts: reduce gradients in fp32 or bf16 (half the bytes, rounded sums); null = fp32 under mixed
    precision, else the parameters' dtype."""
    float8: str = "off"
    """float8 training of the blocks' linear layers (torchao, pip install 'lightning-dist[float8]'): tensorwise (one
    scale per tensor; FSDP2 all-gathers the weights in float8), rowwise (one scale per row) or off. Emulated where
    the GPU has no float8 matmuls (and on CPU); checkpoints keep the parameters' dtype."""
    loss_chunks: int = 0
    """Compute the head and the cross-entropy in this many pieces of the tokens, each recomputed in the backward:
    the (B, T, vocab) logits are never held whole (1/n of their memory, one more head matmul); 0 = off."""
