"""Every collective one rank issues in one optimizer step of a GPT layout, counted from the model's shapes.

The same definitions as the telemetry's ``comm/<axis>/bytes`` and ``calls`` (nccl-tests' "size": the whole tensor
of an all-gather / reduce-scatter / all-reduce, the message of a send or receive), so a CPU run of any layout
measures exactly these numbers (``tests/distributed`` checks it per layout). What issues them, per step:

- **FSDP2** (any data parallelism under the mesh strategy): per unit (a block; the rest of a stage: embedding,
  final norm, head) an all-gather of its tp-local parameters in the compute dtype, dim 0 padded to a multiple of
  ``dp_shard``, in the forward and again in the backward of every micro batch (the last block and the rest: in the
  forward only; pipeline stages keep them gathered: one per step); one reduce-scatter of the gradients in the reduce
  dtype; with replicas, one all-reduce of the reduced shard over ``dp_replicate`` (``dp_shard=1``: of the whole
  gradient, no all-gather), except under DiLoCo, whose replicas exchange nothing in an inner step. Under sequence
  parallelism the norm weights' gradients are partial sums over tp: FSDP2 all-reduces each before its
  reduce-scatter; without FSDP2 the strategy sums them in one all-reduce.
- **TP with sequence parallelism** per micro batch: per block an all-gather before attention and MLP and a
  reduce-scatter after them, in the forward and the backward (and the recomputed forward's); the vocabulary-
  parallel embedding a reduce-scatter, the head an all-gather; the parallel loss three all-reduces of one fp32 per
  token (max, sum of exponentials, target logit).
- **CP** (context parallelism, :mod:`lightning_dist.parallel.context`) per block and micro batch: an all-gather of
  this rank's keys and values (stacked, the tp-local key / value heads, compute dtype) in the forward, so its size
  is the whole sequence's ``2 b (K / t) D T`` elements, again when the block is recomputed, and a reduce-scatter of
  their gradients (the same size) in the backward. FSDP2 then shards over ``dp_shard x cp`` (``dp_shard_cp``,
  reported as ``dp``), and every other per-token term above counts the local ``T / cp`` tokens.
- **PP** per microbatch and virtual stage: the activation received from the previous stage and sent to the next,
  the gradient the other way (sequence-sharded under TP); the loss broadcast from the last stage per batch; the
  gradient norm's square summed over the stages.
- **Gradient norm** (mesh strategy): the per-tensor norms are stacked and all-reduced (fp32) over each axis that
  shards a gradient.
- **The loop** (the app's, on the default group): the preemption flag (4 bytes per step, non-blocking; it replaces
  Lightning's per-batch SIGTERM broadcast); on logging steps the step loss's ``sync_dist`` (4 bytes) and the loss
  history of the steps since the last logging step (4 bytes each). Counted for ``log_every_n_steps=1``, where every
  step logs; with ``k`` the last two add up to ``4 + 4k`` bytes in 2 calls per ``k`` steps.
- **DiLoCo's outer steps** (``sync="diloco"``, :func:`outer_collectives`; not per step: per cycle of H inner steps):
  each of the F fragments of the rank's parameter shard once, over ``dp_replicate``, as
  :mod:`lightning_dist.parallel.diloco` sends it: fp32 one all-reduce of 4 bytes per element; bf16 and int8 an
  all-gather of every replica's payload (2 bytes per element; 1 byte per element plus one fp32 scale per block of
  256), so its telemetry size is ``dp_replicate`` payloads. Per step on average: the cycle's bytes / H.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.compression import exchange_sizes
from lightning_dist.parallel.diloco import build_fragments
from lightning_dist.parallel.pipeline import stage_ids
from lightning_dist.parallel_dims import DP, DP_CP, DP_SHARD_CP, EFSDP, EFSDP_CP, EP, REPORTED_AXIS
from lightning_dist.plan.layout import Layout, stage_blocks
from lightning_dist.plan.tensors import (
    Collective,
    Dtypes,
    Tensor,
    expert_tensors,
    moe_block_tensors,
    moe_blocks_of_stage,
)

DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * 2**20, 2**20  # torch DDP's bucket_cap_mb and first bucket


def block_tensors(cfg: GPTConfig, tp: int, sequence_parallel: bool = True) -> list[Tensor]:
    """One block's parameters, tp-local (q / k / v / gate / up column-parallel, o / down row-parallel)."""
    h, f, hd = cfg.d_model, cfg.hidden_dim, cfg.head_dim
    sp = tp > 1 and sequence_parallel  # norms on sequence shards: partial weight gradients
    if cfg.arch == "gpt2":  # LayerNorms and biases (a Megatron-style plan: our strategy's TP is llama-only)
        kv = cfg.kv_heads * hd // tp
        q = cfg.n_heads * hd // tp
        return [
            Tensor(h, 1, sp),
            Tensor(h, 1, sp),
            Tensor(q, h),
            Tensor(q, 1),
            Tensor(kv, h),
            Tensor(kv, 1),
            Tensor(kv, h),
            Tensor(kv, 1),
            Tensor(h, q),
            Tensor(h, 1, sp),
            Tensor(h, 1, sp),
            Tensor(h, 1, sp),
            Tensor(f // tp, h),
            Tensor(f // tp, 1),
            Tensor(h, f // tp),
            Tensor(h, 1, sp),
        ]
    return [
        Tensor(h, 1, sp),  # attention norm
        Tensor(cfg.n_heads * hd // tp, h),
        Tensor(cfg.kv_heads * hd // tp, h),
        Tensor(cfg.kv_heads * hd // tp, h),
        Tensor(h, cfg.n_heads * hd // tp),
        Tensor(h, 1, sp),  # MLP norm
        Tensor(f // tp, h),
        Tensor(f // tp, h),
        Tensor(h, f // tp),
    ]


def root_tensors(
    cfg: GPTConfig, tp: int, first: bool, last: bool, pp: int, sequence_parallel: bool = True
) -> list[Tensor]:
    """The parameters outside the blocks that a stage holds: embedding(s) on the first, norm and head on the last."""
    tensors = []
    if first:
        tensors.append(Tensor(cfg.vocab_size // tp, cfg.d_model))
        if cfg.arch == "gpt2":
            tensors.append(Tensor(cfg.max_seq_len, cfg.d_model))
    if last:
        tensors.append(Tensor(cfg.d_model, 1, tp > 1 and sequence_parallel))
        if cfg.arch == "gpt2":
            tensors.append(Tensor(cfg.d_model, 1))
        if not (cfg.tie_embeddings and pp == 1):  # tied across stages: a copy on the last one
            tensors.append(Tensor(cfg.vocab_size // tp, cfg.d_model))
    return tensors


def stage_units(
    cfg: GPTConfig, pp: int, stages_per_rank: int, schedule: str, stage: int
) -> list[tuple[int, bool, bool]]:
    """``(blocks, first, last)`` of each virtual stage pipeline rank ``stage`` holds, split as the strategy splits."""
    total = pp * stages_per_rank
    blocks = stage_blocks(cfg, total)
    ids = stage_ids(stage, pp, stages_per_rank, schedule) if pp > 1 else [0]
    return [(blocks[i], i == 0, i == total - 1) for i in ids]


def _remote_neighbours(pp: int, stages_per_rank: int, schedule: str, stage: int) -> int:
    """Stage boundaries rank ``stage`` talks across (a V schedule's two middle stages share a rank)."""
    total = pp * stages_per_rank
    mine = set(stage_ids(stage, pp, stages_per_rank, schedule))
    return sum(1 for i in mine for j in (i - 1, i + 1) if 0 <= j < total and j not in mine)


def step_collectives(
    cfg: GPTConfig,
    layout: Layout,
    seq_len: int,
    precision: str = "bf16-mixed",
    stage: int | None = None,
    ddp: bool = False,
    loop: bool = True,
) -> list[Collective]:
    """The collectives pipeline rank ``stage`` issues in one optimizer step of ``layout``.

    Args:
        cfg: The GPT.
        layout: A :class:`lightning_dist.plan.layout.Layout`.
        seq_len: Tokens per sample.
        precision: Lightning's precision string (dtypes of gathers, reductions and activations).
        stage: The rank's pp coordinate; ``None``: the first stage for pp <= 2, else the second (sends both ways).
        ddp: Lightning's ``DDPStrategy`` (``parallelism=ddp``) instead of the mesh strategy's FSDP2.
        loop: Count the training loop's scalars (Lightning's and ours) too.
    """
    rank = _StepRank.of(cfg, layout, seq_len, precision, stage)
    out = _Collectives()
    if layout.world > 1 and loop:
        _loop_scalars(rank, out)
    if (
        rank.moe and layout.dims.dp_cp_size > 1
    ):  # the routers' counts and loss sums (parallel/step.py: finish_gradients)
        load = rank.moe * (cfg.moe.num_experts + 3) * 4
        out.add(rank.world if ddp else DP, "all_reduce", load, 1, "the MoE routers' load")
    if ddp:
        _ddp_buckets(rank, out)
        return out
    _data_parallel(rank, out)
    if layout.cp > 1:
        _context_parallel(rank, out)
    if layout.tp > 1:
        _tensor_parallel(rank, out)
    _gradient_norm(rank, out)
    if layout.pp > 1:
        _pipeline(rank, out, loop)
    return out


class _Collectives(list[Collective]):
    """The step's collectives, in the order they are counted."""

    def add(self, axis: str, op: str, size: float, calls: int, what: str) -> None:
        if calls > 0:
            self.append(Collective(axis, op, int(size), calls, what))


@dataclass(frozen=True)
class _StepRank:
    """What one pipeline rank's step is made of, for the collectives it issues."""

    cfg: GPTConfig
    lay: Layout
    dt: Dtypes
    seq_len: int
    stage: int
    units: list[tuple[int, bool, bool]]  # (blocks, first, last) of each virtual stage it holds
    blocks: int
    moe: int  # its MoE blocks (after the dense ones: moe.dense_layers)
    roots: list[list[Tensor]]
    block: list[Tensor]
    experts: list[Tensor]
    moe_block: list[Tensor]
    all_tensors: list[Tensor]
    shard: int  # FSDP2's group: dp_shard x cp (cp ranks share parameters)
    shard_axis: str
    world: str  # the axis the default group is reported as

    @classmethod
    def of(cls, cfg: GPTConfig, lay: Layout, seq_len: int, precision: str, stage: int | None) -> _StepRank:
        pp, tp, ds, cp = lay.pp, lay.tp, lay.dp_shard, lay.cp
        shard, shard_axis = ds * cp, DP_SHARD_CP if cp > 1 else "dp_shard"
        if cp == lay.world:  # cp spans the world: FSDP2's group is the cp group (one group object, reported as cp)
            shard_axis = "cp"
        stage = (0 if pp <= 2 else 1) if stage is None else stage
        units = stage_units(cfg, pp, lay.stages_per_rank, lay.schedule, stage)
        blocks = sum(n for n, _, _ in units)
        sp = lay.sequence_parallel
        roots = [root_tensors(cfg, tp, first, last, pp, sp) for _, first, last in units]
        block = block_tensors(cfg, tp, sp)
        moe = moe_blocks_of_stage(cfg, lay, stage)
        experts = expert_tensors(cfg, lay.ep) if moe else []
        moe_block = moe_block_tensors(cfg, tp, sp) + (experts if lay.ep == 1 else [])  # ep > 1: the experts' own unit
        moe_tensors = (moe_block_tensors(cfg, tp, sp) + experts) * moe
        all_tensors = [t for root in roots for t in root] + block * (blocks - moe) + moe_tensors
        # The default group is reported as the one axis it spans, if it spans one (the data-parallel axes count as
        # one, named dp_shard when it shards).
        spanned = {REPORTED_AXIS[axis] for axis, size in lay.dims.degrees.items() if size > 1}
        world = spanned.pop() if len(spanned) == 1 else "world"
        if world == DP:
            world = "dp_shard" if ds > 1 else "dp_replicate"
        if world == "world" and cp > 1 and tp == pp == 1:  # dp x cp: the flattened dp_cp group spans the world
            world = DP_CP
        return cls(
            cfg=cfg,
            lay=lay,
            dt=Dtypes.of(precision),
            seq_len=seq_len,
            stage=stage,
            units=units,
            blocks=blocks,
            moe=moe,
            roots=roots,
            block=block,
            experts=experts,
            moe_block=moe_block,
            all_tensors=all_tensors,
            shard=shard,
            shard_axis=shard_axis,
            world=world,
        )

    @property
    def stream(self) -> int:
        """Bytes per element of the residual stream: FSDP2 computes in bf16 from bf16 parameters; without it, autocast
        leaves the embedding, the residual stream and the norm outputs in the fp32 of the parameters."""
        return self.dt.compute if self.lay.dp_replicate * self.shard > 1 else self.dt.master


def _loop_scalars(rank: _StepRank, out: _Collectives) -> None:
    """The training loop's own scalars: the preemption flag, and on logging steps ``train/loss``."""
    out.add(rank.world, "all_reduce", 4, 1, "the preemption flag")
    # Logging steps' train/loss sync_dist and loss history: over the data-parallel ranks (strategies/metrics.py).
    logged = "train/loss sync_dist and the loss history (logging)"
    if rank.lay.dims.model_parallel_size == 1:
        out.add(rank.world, "all_reduce", 4, 2, logged)
    elif rank.lay.dims.dp_cp_size > 1:  # over dp x cp (dp_cp), the ranks holding other tokens
        out.add(DP, "all_reduce", 4, 2, logged)


def _ddp_buckets(rank: _StepRank, out: _Collectives) -> None:
    """Lightning's DDP: the gradients all-reduced in its buckets."""
    size = sum(t.dim0 * t.rest for t in rank.all_tensors) * rank.dt.reduce
    buckets = 1 + math.ceil(max(0, size - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)
    out.add("dp_replicate", "all_reduce", size / buckets, buckets, "DDP gradient buckets")


def _data_parallel(rank: _StepRank, out: _Collectives) -> None:
    """FSDP2's gathers and reductions, one unit per block and one for the rest of each stage (the experts' own under
    ep > 1); without FSDP2, tensor parallelism's partial gradients (sequence-parallel norms) in one all-reduce."""
    lay, dt, blocks, moe, shard = rank.lay, rank.dt, rank.blocks, rank.moe, rank.shard
    micro = lay.microbatches  # micro batches per step: pipeline microbatches, or accumulated batches
    if lay.dp_replicate * shard <= 1:
        partial = sum(t.dim0 * t.rest for t in rank.all_tensors if t.partial_grad)
        if lay.tp > 1:
            out.add("tp", "all_reduce", partial * dt.master, 1 if partial else 0, "SP norm gradients (one coalesced)")
        return
    unit_tensors = [rank.block] * (blocks - moe) + [rank.moe_block] * moe + [root for root in rank.roots if root]
    # (tensors, FSDP2 group size, its axis, gathered once): the blocks' units, then the experts' under ep > 1
    units = [(tensors, shard, rank.shard_axis, index >= blocks - 1) for index, tensors in enumerate(unit_tensors)]
    if lay.ep > 1:  # FSDP2 over the ranks holding the same experts (efsdp x cp)
        expert_axis = EFSDP_CP if lay.cp > 1 else EFSDP
        units += [(rank.experts, shard // lay.ep, expert_axis, index == moe - 1) for index in range(moe)]
    # FSDP2 accumulates unsharded gradients over micro batches in the reduce dtype, else keeps the compute dtype.
    partial_bytes = dt.reduce if micro > 1 else dt.compute
    float8 = lay.options.float8 == "tensorwise"  # the blocks' linear weights gathered in float8 (parallel/float8.py)
    for index, (tensors, group, axis, once) in enumerate(units):
        # The last block and the root (embedding, norm, head) stay gathered from their forward to their backward
        # (parallel/data.py: apply_fsdp); the last experts' unit too.
        gathers = 1 if lay.pp > 1 else micro if once else 2 * micro
        padded = sum(t.padded(group) for t in tensors)
        in_float8 = sum(t.padded(group) for t in tensors if t.rest > 1) if float8 and index < blocks else 0
        if group > 1:
            size = (padded - in_float8) * dt.compute + in_float8
            out.add(axis, "all_gather", size, gathers, "FSDP2 parameters (block linears in float8)")
            out.add(axis, "reduce_scatter", padded * dt.reduce, 1, "FSDP2 gradients")
        if lay.dp_replicate > 1 and not lay.diloco:  # DiLoCo: FSDP2 reduces over dp_shard only (parallel/compose.py)
            out.add("dp_replicate", "all_reduce", padded // group * dt.reduce, 1, "FSDP2 gradients over replicas")
        for t in tensors:
            if t.partial_grad:
                out.add("tp", "all_reduce", t.dim0 * t.rest * partial_bytes, 1, "FSDP2: SP norm gradient")


def _context_parallel(rank: _StepRank, out: _Collectives) -> None:
    """Keys and values of every block: gathered in the forward (and recomputation), gradients scattered."""
    lay, cfg = rank.lay, rank.cfg
    micro = lay.microbatches
    kv = 2 * lay.micro_batch * cfg.kv_heads // lay.tp * cfg.head_dim * rank.seq_len * rank.dt.compute  # whole seq's
    again = recomputed_blocks(lay, rank.blocks)
    out.add("cp", "all_gather", kv, micro * (rank.blocks + again), "CP: keys and values of the whole sequence")
    out.add("cp", "reduce_scatter", kv, micro * rank.blocks, "CP: gradients of the keys and values")


def _tensor_parallel(rank: _StepRank, out: _Collectives) -> None:
    """Tensor (and sequence) parallelism's activations, and the loss over vocab-sharded logits."""
    lay, dt, blocks, units, stream = rank.lay, rank.dt, rank.blocks, rank.units, rank.stream
    micro = lay.microbatches
    local_seq = rank.seq_len // lay.cp  # this rank's tokens of a sequence
    tokens = lay.micro_batch * local_seq * rank.cfg.d_model  # elements of one whole (micro batch, seq, d_model)
    # A checkpointed block runs its forward again up to its MLP input all-gather (torch's recomputation stops once
    # every saved tensor is back, before the block's last reduce-scatter); the op-level policies too: they keep
    # matmul and attention outputs, not collectives. activation_checkpointing.selective=<n>: every n-th block.
    again = recomputed_blocks(lay, blocks) / blocks if blocks else 0
    ends = sum(1 for _, first, _ in units if first) + sum(1 for _, _, last in units if last)
    lasts = sum(1 for _, _, last in units if last)
    # The norm outputs gathered before attention and MLP (and again when recomputed), the head's input, and the
    # embedding gradient move the stream dtype; the backward of the matmul outputs' reduce-scatters moves theirs.
    # Reduce-scatters: matmul outputs (and again when recomputed) / the gradients of the gathers.
    if lay.sequence_parallel:
        out.add("tp", "all_gather", tokens * stream, micro * round((2 + 2 * again) * blocks + ends), "TP: norm outputs")
        out.add("tp", "all_gather", tokens * dt.compute, micro * 2 * blocks, "TP: gradients of matmul outputs")
        out.add("tp", "reduce_scatter", tokens * dt.compute, micro * round((2 + again) * blocks), "TP: matmul outputs")
        out.add("tp", "reduce_scatter", tokens * stream, micro * (2 * blocks + ends), "TP: gradients of norm outputs")
    else:  # replicated activations: all-reduces of the row-parallel outputs and the column-parallel inputs' grads
        out.add("tp", "all_reduce", tokens * stream, micro * (ends - lasts), "TP: embedding output")
        out.add("tp", "all_reduce", tokens * dt.compute, micro * round((2 + again) * blocks), "TP: matmul outputs")
        grads = "TP: gradients of q/k/v/gate/up/head inputs"
        out.add("tp", "all_reduce", tokens * stream, micro * (5 * blocks + lasts), grads)
    if lay.loss_parallel:
        out.add("tp", "all_reduce", lay.micro_batch * local_seq * 4, 3 * micro * lasts, "loss parallel")
    else:
        logits = lay.micro_batch * local_seq * rank.cfg.vocab_size * dt.compute
        out.add("tp", "all_gather", logits, micro * lasts, "TP: the head's logits gathered")


def _gradient_norm(rank: _StepRank, out: _Collectives) -> None:
    """The norm over every axis. Under ep the experts' gradients live on their own mesh: their norms are reduced
    apart (parallel/clip.py), over the flattened dp_shard (efsdp x ep), or ep alone where no other rank holds the
    same experts."""
    lay, shard = rank.lay, rank.shard
    n_experts = len(rank.experts) * rank.moe if lay.ep > 1 else 0
    n_grads = len(rank.all_tensors) - n_experts
    if lay.dp_replicate * shard <= 1 and lay.tp <= 1:
        return
    if shard > 1:
        out.add(rank.shard_axis, "all_reduce", 4 * n_grads, 1, "gradient norm")
        experts_axis = rank.shard_axis if shard > lay.ep else EP
        out.add(experts_axis, "all_reduce", 4 * n_experts, 1 if n_experts else 0, "gradient norm of the experts")
    if lay.tp > 1:
        out.add("tp", "all_reduce", 4 * n_grads, 1, "gradient norm")


def _pipeline(rank: _StepRank, out: _Collectives, loop: bool) -> None:
    """Activations and their gradients between stages, the loss from the last stage, the norm over stages, a weight
    tied across stages."""
    lay, cfg = rank.lay, rank.cfg
    pp, micro = lay.pp, lay.microbatches
    message = lay.micro_batch * rank.seq_len * cfg.d_model * rank.stream // lay.tp
    sends = _remote_neighbours(pp, lay.stages_per_rank, lay.schedule, rank.stage)
    out.add("pp", "send", message, micro * sends, "PP: activations forward, gradients backward")
    out.add("pp", "recv", message, micro * sends, "PP: activations and gradients received")
    out.add("pp", "broadcast", 4, 1 if loop else 0, "PP: loss from the last stage")  # one Lightning batch per step
    out.add("pp", "all_reduce", 4, 1, "gradient norm over stages")
    if cfg.tie_embeddings and any(first or last for _, first, last in rank.units):
        tied = cfg.vocab_size * cfg.d_model // lay.tp // lay.dp_shard * rank.dt.reduce
        out.add("pp" if pp == 2 else "other", "all_reduce", tied, 1, "tied embedding gradient")


def outer_collectives(cfg: GPTConfig, layout: Layout, stage: int | None = None) -> list[Collective]:
    """The collectives of one DiLoCo cycle (H inner steps) on pipeline rank ``stage``: one per fragment; ``[]``
    without DiLoCo. Divide their bytes by H for a step's average (what the telemetry's per-step mean reads).

    Raises:
        ValueError: More fragments than the rank has blocks (the strategy refuses it too).
    """
    lay = layout
    if not lay.diloco:
        return []
    opts, n, compression = lay.options.diloco, lay.dp_replicate, lay.options.diloco.compression
    out = []
    what = {"all_reduce": "all-reduced", "all_to_all": "chunks reduce-scattered", "all_gather": "means gathered"}
    for numel in fragment_elements(cfg, lay, stage):  # as parallel/compression.py sends it
        for op, size in exchange_sizes(numel, compression, n):
            out.append(Collective("dp_replicate", op, size, 1, f"DiLoCo pseudo-gradient ({compression}, {what[op]})"))
    assert len(out) == opts.fragments * (1 if compression == "fp32" else 2)
    return out


def fragment_elements(cfg: GPTConfig, layout: Layout, stage: int | None = None) -> list[int]:
    """Elements of this rank's shard in each DiLoCo fragment, split by :func:`lightning_dist.parallel.diloco.
    build_fragments` over whole blocks (the embedding with the first, the final norm and head with the last)."""
    lay = layout
    pp, tp, ds = lay.pp, lay.tp, lay.fsdp_shard
    stage = (0 if pp <= 2 else 1) if stage is None else stage
    sp = lay.sequence_parallel

    def local(tensors: list[Tensor]) -> int:
        return sum(t.padded(ds) // ds for t in tensors)  # FSDP2's dim-0 shard of rank 0

    block = local(block_tensors(cfg, tp, sp))
    named: list[tuple[str, int]] = []
    blocks: list[str] = []
    for v, (count, first, last) in enumerate(stage_units(cfg, pp, lay.stages_per_rank, lay.schedule, stage)):
        if first:
            named.append(("embedding", local(root_tensors(cfg, tp, True, False, pp, sp))))
        for b in range(count):
            blocks.append(f"{v}.{b}")
            named.append((f"{v}.{b}.weights", block))
        if last:
            named.append(("head", local(root_tensors(cfg, tp, False, True, pp, sp))))
    # Local sizes decide the split here, whole-tensor sizes in the strategy: they differ only by the replicated norm
    # weights (d_model elements against a block's millions), which moves no boundary.
    sizes = dict(named)
    return [
        sum(sizes[name] for name in fragment)
        for fragment in build_fragments(named, lay.options.diloco.fragments, blocks)
    ]


def recomputed_blocks(layout: Layout, blocks: int) -> int:
    """Blocks of a stage whose forward runs again in the backward under the layout's activation checkpointing."""
    if layout.ac == "none":
        return 0
    if layout.ac == "full" or layout.ac_selective in ("op", "op_half"):
        return blocks
    return math.ceil(blocks / int(layout.ac_selective))  # blocks 0, n, 2n, ... of the stage


def per_axis(collectives: list[Collective]) -> dict[str, dict[str, int]]:
    """``{axis: {"bytes": ..., "calls": ...}}`` with the telemetry's axis names (``dp`` for both data axes)."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "calls": 0})
    for c in collectives:
        axis = REPORTED_AXIS.get(c.axis, c.axis)  # "world" and "other" are reported as they are
        totals[axis]["bytes"] += c.bytes
        totals[axis]["calls"] += c.calls
    return dict(totals)
