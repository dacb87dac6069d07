"""Per-rank memory of a GPT training layout: what a rank holds at its peak, in bytes, and the assumptions behind it.

Model states (parameters, gradients, AdamW moments) are counted from the rank's own shards: either traced through the
real parallelize path on the fake process-group backend (:mod:`lightning_dist.plan.trace`) or counted here from
the shapes. Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), redone for this GPT's layers as torch runs them (a 2-byte bf16 activation per element):

- per block and token, with tensor parallelism ``t`` and sequence parallelism, the tensors autograd keeps are
  ``(13h + 1.5kv + 4f + g) / t + 2h`` elements for the llama block (``h`` = d_model, ``kv`` = key + value width,
  ``f`` = MLP hidden; each RMSNorm keeps two fp32 tensors, its input's copy and the normalized one, RoPE new q / k,
  SwiGLU three f-wide tensors, and under grouped-query attention attention keeps the keys and values repeated to
  every query head, ``g = 2 H D - kv`` more; the two matmul inputs all-gathered from sequence shards are whole:
  torch saves them, Megatron re-gathers them). Checked against torch's ``MemTracker`` on fake tensors: an
  8B-wide block (no checkpointing) keeps 113.9k elements per token, 111.6k by this formula
  (``tests/distributed/test_plan_trace.py``, within 5%);
- ``selective`` (op) keeps only matmul / attention outputs and the block input: ``(3h + kv + 2f) / t + 2h``
  (the o / down matmul outputs, under tp partial sums over the whole sequence before the reduce-scatter).
  MemTracker: 52.0k elements per token for an 8B-wide block, 51.2k by this formula. ``op_half`` (torchtitan's
  policy) keeps q, v, gate and down of the seven matmuls: ``(3h + kv / 2 + f) / t + h``, 32.6k measured, 31.7k;
- ``full`` keeps the block input ``h / t``, plus one block's whole set while it is recomputed;
- the loss head: per token ``V / t`` logits, 10 bytes each at the end of the loss's forward (the bf16 logits, their
  fp32 copy and the fp32 log-softmax kept for backward; the backward frees the first two before it allocates). Measured,
  not assumed: torch's ``MemTracker`` on fake tensors gives 10.5 bytes per logit for an 8B-wide GPT (the peak's change
  with the vocabulary, model states taken off; ``tests/distributed/test_plan_trace.py``). At a 128K vocabulary this
  is the largest single term;
- with ``loss_chunks=n`` (:func:`lightning_dist.models.loss.chunked_token_loss`) the head and loss run on one
  ``1 / n`` piece of the tokens at a time, recomputed in the backward: the same bytes per logit for one piece (the
  piece's logits, their fp32 copy, log-softmax and gradient live only while it is computed). MemTracker on fake tensors
  (``tests/distributed/test_plan_trace.py``) measures the peak's change with the vocabulary against this;
- float8 (``parallelism.float8``, torchao) keeps the same activations: its matmuls save their high-precision inputs
  and cast them again in the backward (saved-tensor hooks on a Llama block: the same bytes per token with and
  without). Under FSDP2, tensorwise gathers the converted weights in float8 (1 byte per element);
- a pipeline stage holds its blocks' activations for the microbatches in flight: 1 (no pipeline), ``min(m, pp)`` on
  the first stage of 1F1B-like schedules, all ``m`` for GPipe / LoopedBFS.

Context parallelism (``cp``, :mod:`lightning_dist.parallel.context`): a rank computes on ``T / cp`` tokens of each
sequence, so every term above counts local tokens, except what the all-gather attention keeps for the backward of
each block it runs uncheckpointed (measured with saved-tensor hooks, :mod:`lightning_dist.plan.measure`):

- the keys and values of the whole sequence, of the key / value heads (SDPA's ``enable_gqa``): ``2 (K / t) D T``
  elements per sample, in place of the local ones repeated to the query heads, ``2 (H / t) D T / cp``;
- on CPU, the two chunks' queries and outputs padded with zero queries to the chunk's end (``c = T / 2cp`` rows;
  ends ``c (r + 1)`` and ``c (2cp - r)``, ``T + c`` in all), so that SDPA's causal flag is the chunk's mask and no
  quadratic mask is kept: ``2 (H / t) D (T + c - T / cp)`` more, the fp32 logsumexp of those rows, and the
  concatenated output ``(H / t) D`` per local token (:func:`cp_block_extra`). On CUDA SDPA takes the lower-right
  causal mask as a flag and keeps no padding: the planner over-counts it there (an upper bound; not measured on a GPU);
- once per rank, the int64 order of the gathered tokens (8 bytes per token of the sequence).

Under ``selective`` the attention's inputs are recomputed (only its output is kept): no extra; the block recomputed
in the backward holds all of it.

With ``cpu_offload`` FSDP2 keeps the parameter shards, their gradients and the AdamW state in host memory (counted
as the states, outside the device's total) and copies one unit's fp32 shard to the device for each all-gather.

FSDP2 buffers: two all-gathered bf16 units (the current one and the prefetched next) and one unit's fp32 unsharded
gradient before its reduce-scatter. A margin (default 10%) covers the allocator's fragmentation; the CUDA context
(about 1 GiB) is taken off the device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.lora_config import NF4_BYTES_PER_PARAM
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.moe_memory import (
    expert_params,
    expert_shard,
    moe_activation_elements,
    moe_dense_params,
    moe_layers,
    moe_selective_elements,
)

GIB = 2**30
ACT_BYTES = 2  # bf16 activations (bf16-mixed)
LOGIT_BYTES = 10  # per logit at the loss's peak: bf16 logits, fp32 copy, fp32 log-softmax (module docstring)
STATE_BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master weights, fp32 grads, AdamW m and v
ALL_IN_FLIGHT = ("GPipe", "LoopedBFS")


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's peak memory by part, in bytes; ``total`` adds the allocator margin."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    margin: float = 0.10
    outer_sync: int = 0  # DiLoCo's exchange buffers, after the step (activations freed): beside the states only
    offloaded: bool = False  # cpu_offload: the states live in host memory, not in the device's total

    @property
    def total(self) -> int:
        states = 0 if self.offloaded else self.params + self.grads + self.optimizer
        parts = states + self.activations + self.logits + self.buffers
        return int(max(parts, states + self.outer_sync) * (1 + self.margin))

    def gib(self) -> dict[str, float]:
        """Every part and the total in GiB, rounded to 0.01."""
        names = ("params", "grads", "optimizer", "activations", "logits", "buffers", "outer_sync", "total")
        return {name: round(getattr(self, name) / GIB, 2) for name in names}

    def fits(self, device_gib: float, context_gib: float = 1.0) -> bool:
        """Whether the total fits a device of ``device_gib`` after the CUDA context."""
        return self.total <= (device_gib - context_gib) * GIB


def block_activation_elements(
    cfg: GPTConfig, tp: int, mode: str, selective: str = "op", moe: bool = False, ep: int = 1
) -> float:
    """Activation elements one block keeps per token of its input (see the module docstring), averaged over blocks
    for ``selective="<n>"`` (every n-th block full, the others none). ``moe``: an MoE block, its experts split over
    ``ep`` (:mod:`lightning_dist.plan.moe_memory` in place of the MLP's terms)."""
    h, f = cfg.d_model, cfg.hidden_dim
    kv = 2 * cfg.kv_heads * cfg.head_dim
    gathered = 2 * h if tp > 1 else 0  # all-gathered matmul inputs, whole on every tp rank
    if cfg.arch == "gpt2":  # LayerNorm keeps its input and statistics; GELU MLP keeps two f-wide tensors, no RoPE
        none = (8 * h + kv + 2 * f) / tp + gathered
        op = (3 * h + kv + f) / tp + gathered
    else:
        repeated = 2 * cfg.n_heads * cfg.head_dim - kv if cfg.kv_heads < cfg.n_heads else 0
        none = (13 * h + 1.5 * kv + 4 * f + repeated) / tp + gathered
        op = (3 * h + kv + 2 * f) / tp + 2 * h  # + the o / down outputs (whole partial sums under tp)
        op_half = (3 * h + kv / 2 + f) / tp + h  # q, v, gate, down (every other matmul), attention, input
        if moe:  # the MoE sub-layer's terms in place of the MLP's
            none += moe_activation_elements(cfg, tp, ep) - 4 * f / tp
            op += moe_selective_elements(cfg, tp) - 2 * f / tp
            op_half += moe_selective_elements(cfg, tp, half=True) - f / tp
    if tp == 1:  # the norm outputs are the matmul inputs: counted once
        none -= 2 * h
    full = h / tp
    if mode == "none":
        return none
    if mode == "full":
        return full
    if selective == "op":
        return op
    if selective == "op_half" and cfg.arch != "gpt2":
        return op_half
    every = int(selective)
    return (full + (every - 1) * none) / every


def estimate_memory(
    cfg: GPTConfig,
    dims: ParallelDims,
    options: Parallelism,
    *,
    local_params: int,
    seq_len: int,
    micro_batch: int,
    margin: float = 0.10,
) -> MemoryEstimate:
    """Peak memory of the worst rank of a GPT layout (the first pipeline stage, holding the most microbatches).

    Args:
        cfg: The model.
        dims: The layout's degrees (``tp``, ``dp_shard``, ``cp`` and ``pp`` matter here).
        options: Its options: the pipeline schedule and microbatches, activation checkpointing.
        local_params: Parameters this rank holds (its shards; from a trace, or :func:`count_local_params`); with
            ``cfg.lora`` the base's, the adapters' added here (they alone have gradients and optimizer state); with
            ``cfg.lora.quantize`` (QLoRA) the blocks' linear weights are counted whole, in NF4, on every rank.
        seq_len: Tokens per sample.
        micro_batch: Samples per forward: ``data.micro_batch_size`` (under pp, one pipeline microbatch).
        margin: Allocator fragmentation margin on the total.
    """
    tp, dp_shard, pp, cp = dims.tp, dims.dp_shard, dims.pp, dims.cp
    tokens = micro_batch * seq_len // cp  # this rank's tokens of a micro batch
    blocks = -(-cfg.n_layers // pp)
    chunk = -(-tokens // max(1, options.loss_chunks))  # the tokens whose logits are alive at once
    logits = int(chunk * cfg.vocab_size / tp * LOGIT_BYTES)
    qlora = cfg.lora.enabled and cfg.lora.quantize is not None
    # QLoRA: the blocks' linear weights stay whole on every rank, in NF4 (FSDP2 leaves them alone: models/qlora.py)
    linears = blocks * block_linear_params(cfg) / tp if qlora else 0
    trainable = local_params
    base_bytes = 0
    if cfg.lora.enabled:  # LoRA: gradients and AdamW moments for the adapters only; the base is held frozen
        trainable = int(blocks * lora_block_params(cfg, tp) / (dp_shard * cp))
        if qlora:  # the sharded fp32 linear weights counted in local_params are held whole in 4 bits instead
            local_params -= int(linears / (dp_shard * cp))
            base_bytes = int(linears * NF4_BYTES_PER_PARAM)
        local_params += trainable
    return MemoryEstimate(
        params=local_params * STATE_BYTES_PER_PARAM["params"] + base_bytes,
        grads=trainable * STATE_BYTES_PER_PARAM["grads"],
        optimizer=trainable * STATE_BYTES_PER_PARAM["optimizer"],
        activations=int(_activations(cfg, dims, options, seq_len, micro_batch)),
        logits=logits,
        buffers=_buffers(cfg, dims, options, qlora),
        margin=margin,
        offloaded=options.fsdp.cpu_offload,
    )


def _activations(cfg: GPTConfig, dims: ParallelDims, options: Parallelism, seq_len: int, micro_batch: int) -> float:
    """Bytes the first pipeline stage's forwards keep for their backward: its blocks (checkpointed as ``options``
    say) for every microbatch in flight, one block recomputed whole, and context parallelism's gathered keys."""
    tp, pp, cp = dims.tp, dims.pp, dims.cp
    ac = options.activation_checkpointing
    microbatches, schedule = options.pipeline.num_microbatches(pp), options.pipeline.schedule
    tokens = micro_batch * seq_len // cp  # this rank's tokens of a micro batch
    blocks = -(-cfg.n_layers // pp)
    in_flight = 1 if pp == 1 else (microbatches if schedule in ALL_IN_FLIGHT else min(microbatches, pp))
    per_block = block_activation_elements(cfg, tp, ac.mode, ac.selective)
    moe = moe_layers(cfg, range(blocks))  # the first stage's MoE blocks (the first moe.dense_layers are dense)
    if moe:
        moe_block = block_activation_elements(cfg, tp, ac.mode, ac.selective, True, dims.ep)
        per_block = ((blocks - moe) * per_block + moe * moe_block) / blocks
    activations = in_flight * tokens * (blocks * per_block + cfg.d_model / tp) * ACT_BYTES
    extra = cp_block_extra(cfg, tp, cp, seq_len, micro_batch)
    activations += in_flight * _uncheckpointed(blocks, ac.mode, ac.selective) * extra
    if ac.mode != "none":  # one block recomputed whole during backward
        whole = block_activation_elements(cfg, tp, "none", moe=moe > 0, ep=dims.ep)  # the larger block, if MoE
        activations += tokens * whole * ACT_BYTES + extra
    if cp > 1:
        activations += 8 * seq_len  # the int64 order of the gathered tokens, one for every block
    return activations


def _buffers(cfg: GPTConfig, dims: ParallelDims, options: Parallelism, qlora: bool) -> int:
    """FSDP2's buffers: two gathered units (the current one and the prefetched next: a block, or the embedding +
    head) and one unit's fp32 unsharded gradient (none for a frozen base under LoRA: the adapters' are negligible);
    QLoRA's one weight dequantized at a time."""
    tp, dp_shard, cp = dims.tp, dims.dp_shard, dims.cp
    buffers = 0
    if dp_shard * cp > 1:
        root = 2 * cfg.vocab_size * cfg.d_model / tp
        f8 = block_linear_params(cfg) if options.float8 == "tensorwise" else 0  # gathered in float8
        unit = (block_params(cfg) - (block_linear_params(cfg) if qlora else 0)) / tp  # a QLoRA base: never gathered
        if moe_layers(cfg, range(-(-cfg.n_layers // dims.pp))):  # an MoE block and its experts (E / ep): the largest
            unit = max(unit, moe_dense_params(cfg) / tp + expert_params(cfg) / dims.ep)
        gathered = max((unit - f8 / tp) * 2 + f8 / tp, root * 2)
        unsharded_grad = 0 if cfg.lora.enabled else 4 * max(unit, root)
        buffers = int(2 * gathered + unsharded_grad)
        if options.fsdp.cpu_offload:  # FSDP2 copies a unit's fp32 shard to the device for its all-gather
            buffers += int(4 * max(unit, root) / (dp_shard * cp))
    if qlora:  # one weight dequantized at a time, for its matmul (and again in the backward)
        buffers += int(4 * cfg.d_model * cfg.hidden_dim / tp)
    return buffers


def cp_block_extra(cfg: GPTConfig, tp: int, cp: int, seq_len: int, micro_batch: int) -> float:
    """Bytes one uncheckpointed block keeps beyond :func:`block_activation_elements` of its local tokens under
    context parallelism (0 at ``cp=1``): whole-sequence keys and values of the key / value heads, and the two chunks'
    queries and outputs padded to the chunks' ends (module docstring); linear in ``seq_len``."""
    if cp == 1:
        return 0.0
    width = cfg.n_heads * cfg.head_dim / tp  # query heads x head_dim of this tp rank
    kv_width = cfg.kv_heads * cfg.head_dim / tp  # key / value heads x head_dim: SDPA's grouped-query path
    local = seq_len // cp
    rows = seq_len + seq_len // (2 * cp)  # padded query rows of the two chunks: their ends, (2cp + 1) c
    gathered = 2 * kv_width * seq_len - 2 * width * local  # whole K/V, K heads, replace the local repeated ones
    padded = 2 * width * (rows - local) + width * local  # padded q and output beyond the local ones; the cat copy
    lse = 2 * (width / cfg.head_dim) * (rows - local)  # fp32 logsumexp per padded row and head: 2 elements
    return micro_batch * (gathered + padded + lse) * ACT_BYTES


def _uncheckpointed(blocks: int, mode: str, selective: str) -> int:
    """Blocks of a stage that keep everything for the backward (``selective="<n>"``: all but every n-th)."""
    if mode == "none":
        return blocks
    if mode == "full" or not selective.isdigit():
        return 0
    return blocks - -(-blocks // int(selective))


def count_local_params(cfg: GPTConfig, tp: int = 1, dp_shard: int = 1, ep: int = 1) -> int:
    """Parameters one rank of a whole-model layout holds: every tensor sharded over ``tp x dp_shard`` (FSDP2's group:
    ``dp_shard x cp``; it pads dim 0 to a multiple of ``dp_shard``; the GPT's shapes divide evenly), except the norm
    weights, which tensor parallelism replicates. An MoE GPT's routers are whole on every tp rank and its routed
    experts split over ``ep`` (:mod:`lightning_dist.plan.moe_memory`; the count is the rank holding the most).
    Pipeline stages: :func:`lightning_dist.plan.experts.local_params` or a trace."""
    h, moe = cfg.d_model, moe_layers(cfg)
    norms = (2 * cfg.n_layers + 1) * h
    embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h
    blocks = (cfg.n_layers - moe) * block_params(cfg) + moe * (moe_dense_params(cfg) - cfg.moe.num_experts * h)
    sharded = blocks - 2 * cfg.n_layers * h + embeddings
    router = -(-cfg.moe.num_experts // dp_shard) * h  # (E, C), dim 0 padded to dp_shard
    experts = expert_shard(cfg, ep, dp_shard, 1)
    return sharded // (tp * dp_shard) + norms // dp_shard + moe * (router + experts)


def lora_block_params(cfg: GPTConfig, tp: int = 1) -> int:
    """LoRA adapter parameters of one block on one tp rank: ``rank x (in + out)`` for each adapted projection, the
    side its base layer's style shards divided by ``tp`` (a colwise layer's B, a rowwise layer's A)."""
    h, f, kv = cfg.d_model, cfg.hidden_dim, cfg.kv_heads * cfg.head_dim
    layers = {
        "q_proj": (h, h, True),
        "k_proj": (h, kv, True),
        "v_proj": (h, kv, True),
        "o_proj": (h, h, False),
        "gate_proj": (h, f, True),
        "up_proj": (h, f, True),
        "down_proj": (f, h, False),
    }
    if cfg.arch != "llama":
        del layers["gate_proj"]
    targets = cfg.lora.targets
    chosen = [k for k in layers if targets is None or any(t.rpartition(".")[2] == k for t in targets)]
    r = cfg.lora.rank
    return sum(r * (i + o // tp) if colwise else r * (i // tp + o) for i, o, colwise in (layers[k] for k in chosen))


def block_linear_params(cfg: GPTConfig) -> int:
    """Weights of one block's linear layers (what float8 converts; the llama block's q, k, v, o, gate, up, down)."""
    h, f = cfg.d_model, cfg.hidden_dim
    kv = 2 * cfg.kv_heads * cfg.head_dim
    return h * (h + kv) + h * h + (3 if cfg.arch == "llama" else 2) * h * f


def block_params(cfg: GPTConfig) -> int:
    """Parameters in one transformer block of ``cfg`` (attention, MLP, norms; biases for ``gpt2``)."""
    h, f = cfg.d_model, cfg.hidden_dim
    kv = 2 * cfg.kv_heads * cfg.head_dim
    mlp = (3 if cfg.arch == "llama" else 2) * h * f
    biases = 2 * h + (2 * h + kv) + (f + h) if cfg.arch == "gpt2" else 0  # norms, attention, MLP
    return h * (h + kv) + h * h + mlp + 2 * h + biases
