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
    lay, dt = layout, Dtypes.of(precision)
    pp, tp, ds, dr, cp = lay.pp, lay.tp, lay.dp_shard, lay.dp_replicate, lay.cp
    shard, shard_axis = ds * cp, DP_SHARD_CP if cp > 1 else "dp_shard"  # FSDP2's group: cp ranks share parameters
    if cp == lay.world:  # cp spans the world: FSDP2's group is the cp group (one group object, reported as cp)
        shard_axis = "cp"
    local_seq = seq_len // cp  # this rank's tokens of a sequence
    stage = (0 if pp <= 2 else 1) if stage is None else stage
    micro = lay.microbatches  # micro batches per step: pipeline microbatches, or accumulated batches
    batches = 1 if pp > 1 else micro  # Lightning batches per optimizer step
    units = stage_units(cfg, pp, lay.stages_per_rank, lay.schedule, stage)
    blocks = sum(n for n, _, _ in units)
    out: list[Collective] = []

    def add(axis: str, op: str, size: float, calls: int, what: str) -> None:
        if calls > 0:
            out.append(Collective(axis, op, int(size), calls, what))

    # The default group is reported as the one axis it spans, if it spans one (the data-parallel axes count as one,
    # named dp_shard when it shards).
    spanned = {REPORTED_AXIS[axis] for axis, size in lay.dims.degrees.items() if size > 1}
    world = spanned.pop() if len(spanned) == 1 else "world"
    if world == DP:
        world = "dp_shard" if ds > 1 else "dp_replicate"
    if world == "world" and cp > 1 and tp == pp == 1:  # dp x cp: the flattened dp_cp group spans the world
        world = DP_CP
    if lay.world > 1 and loop:
        add(world, "all_reduce", 4, 1, "the preemption flag")
        # Logging steps' train/loss sync_dist and loss history: over the data-parallel ranks (strategies/metrics.py).
        logged = "train/loss sync_dist and the loss history (logging)"
        if lay.dims.model_parallel_size == 1:
            add(world, "all_reduce", 4, 2, logged)
        elif lay.dims.dp_cp_size > 1:  # over dp x cp (dp_cp), the ranks holding other tokens
            add(DP, "all_reduce", 4, 2, logged)

    sp = lay.sequence_parallel
    roots = [root_tensors(cfg, tp, first, last, pp, sp) for _, first, last in units]
    block = block_tensors(cfg, tp, sp)
    moe = moe_blocks_of_stage(cfg, lay, stage)  # MoE blocks come after the dense ones (moe.dense_layers)
    if moe and lay.dims.dp_cp_size > 1:  # the routers' token counts and loss sums (parallel/step.py: finish_gradients)
        add(world if ddp else DP, "all_reduce", moe * (cfg.moe.num_experts + 3) * 4, 1, "the MoE routers' load")
    experts = expert_tensors(cfg, lay.ep) if moe else []
    moe_block = moe_block_tensors(cfg, tp, sp) + (experts if lay.ep == 1 else [])  # ep > 1: the experts' own unit
    moe_tensors = (moe_block_tensors(cfg, tp, sp) + experts) * moe
    all_tensors = [t for root in roots for t in root] + block * (blocks - moe) + moe_tensors
    if ddp:
        size = sum(t.dim0 * t.rest for t in all_tensors) * dt.reduce
        buckets = 1 + math.ceil(max(0, size - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)
        add("dp_replicate", "all_reduce", size / buckets, buckets, "DDP gradient buckets")
        return out

    # FSDP2: one unit per block, one for the rest of each stage.
    unit_tensors = [block] * (blocks - moe) + [moe_block] * moe + [root for root in roots if root]
    # (tensors, FSDP2 group size, its axis, gathered once): the blocks' units, then the experts' under ep > 1
    units_ = [(tensors_, shard, shard_axis, index >= blocks - 1) for index, tensors_ in enumerate(unit_tensors)]
    if lay.ep > 1:  # FSDP2 over the ranks holding the same experts (efsdp x cp)
        expert_axis = EFSDP_CP if cp > 1 else EFSDP
        units_ += [(experts, shard // lay.ep, expert_axis, index == moe - 1) for index in range(moe)]
    # FSDP2 computes in bf16 from bf16 parameters; without it, autocast leaves the embedding, the residual stream
    # and the norm outputs in the fp32 of the parameters (only matmul outputs are bf16).
    fsdp = dr * shard > 1
    stream = dt.compute if fsdp else dt.master
    # FSDP2 accumulates unsharded gradients over micro batches in the reduce dtype, else keeps the compute dtype.
    partial_bytes = dt.reduce if micro > 1 else dt.compute
    if fsdp:
        float8 = (
            lay.options.float8 == "tensorwise"
        )  # the blocks' linear weights gathered in float8 (parallel/float8.py)
        for index, (tensors_, group, axis, once) in enumerate(units_):
            # The last block and the root (embedding, norm, head) stay gathered from their forward to their backward
            # (parallel/data.py: apply_fsdp); the last experts' unit too.
            gathers = 1 if pp > 1 else micro if once else 2 * micro
            padded = sum(t.padded(group) for t in tensors_)
            in_float8 = sum(t.padded(group) for t in tensors_ if t.rest > 1) if float8 and index < blocks else 0
            if group > 1:
                size = (padded - in_float8) * dt.compute + in_float8
                add(axis, "all_gather", size, gathers, "FSDP2 parameters (block linears in float8)")
                add(axis, "reduce_scatter", padded * dt.reduce, 1, "FSDP2 gradients")
            if dr > 1 and not lay.diloco:  # DiLoCo: FSDP2 reduces over dp_shard only (parallel/compose.py)
                add("dp_replicate", "all_reduce", padded // group * dt.reduce, 1, "FSDP2 gradients over replicas")
            for t in tensors_:
                if t.partial_grad:
                    add("tp", "all_reduce", t.dim0 * t.rest * partial_bytes, 1, "FSDP2: SP norm gradient")
    elif tp > 1:
        partial = sum(t.dim0 * t.rest for t in all_tensors if t.partial_grad)
        add("tp", "all_reduce", partial * dt.master, 1 if partial else 0, "SP norm gradients (one coalesced)")

    if cp > 1:  # keys and values of every block: gathered in the forward (and recomputation), gradients scattered
        kv = 2 * lay.micro_batch * cfg.kv_heads // tp * cfg.head_dim * seq_len * dt.compute  # the whole sequence's
        again = recomputed_blocks(lay, blocks)
        add("cp", "all_gather", kv, micro * (blocks + again), "CP: keys and values of the whole sequence")
        add("cp", "reduce_scatter", kv, micro * blocks, "CP: gradients of the keys and values")

    if tp > 1:
        tokens = lay.micro_batch * local_seq * cfg.d_model  # elements of one whole (micro batch, seq, d_model) tensor
        # A checkpointed block runs its forward again up to its MLP input all-gather (torch's recomputation stops
        # once every saved tensor is back, before the block's last reduce-scatter); the op-level policies too: they
        # keep matmul and attention outputs, not collectives. ac_selective=<n> checkpoints every n-th block.
        again = recomputed_blocks(lay, blocks) / blocks if blocks else 0
        ends = sum(1 for _, first, _ in units if first) + sum(1 for _, _, last in units if last)
        lasts = sum(1 for _, _, last in units if last)
        # The norm outputs gathered before attention and MLP (and again when recomputed), the head's input, and
        # the embedding gradient move the stream dtype; the backward of the matmul outputs' reduce-scatters moves
        # theirs. Reduce-scatters: matmul outputs (and again when recomputed) / the gradients of the gathers.
        if sp:
            add("tp", "all_gather", tokens * stream, micro * round((2 + 2 * again) * blocks + ends), "TP: norm outputs")
            add("tp", "all_gather", tokens * dt.compute, micro * 2 * blocks, "TP: gradients of matmul outputs")
            add("tp", "reduce_scatter", tokens * dt.compute, micro * round((2 + again) * blocks), "TP: matmul outputs")
            add("tp", "reduce_scatter", tokens * stream, micro * (2 * blocks + ends), "TP: gradients of norm outputs")
        else:  # replicated activations: all-reduces of the row-parallel outputs and the column-parallel inputs' grads
            firsts = ends - lasts
            add("tp", "all_reduce", tokens * stream, micro * firsts, "TP: embedding output")
            add("tp", "all_reduce", tokens * dt.compute, micro * round((2 + again) * blocks), "TP: matmul outputs")
            add(
                "tp",
                "all_reduce",
                tokens * stream,
                micro * (5 * blocks + lasts),
                "TP: gradients of q/k/v/gate/up/head inputs",
            )
        if lay.loss_parallel:
            add("tp", "all_reduce", lay.micro_batch * local_seq * 4, 3 * micro * lasts, "loss parallel")
        else:
            logits = lay.micro_batch * local_seq * cfg.vocab_size * dt.compute
            add("tp", "all_gather", logits, micro * lasts, "TP: the head's logits gathered")

    # Under ep the experts' gradients live on their own mesh: their norms are reduced apart (parallel/clip.py), over
    # the flattened dp_shard (efsdp x ep), or ep alone where no other rank holds the same experts.
    n_experts = len(experts) * moe if lay.ep > 1 else 0
    n_grads = len(all_tensors) - n_experts
    if dr * shard > 1 or tp > 1:
        if shard > 1:
            add(shard_axis, "all_reduce", 4 * n_grads, 1, "gradient norm")
            experts_axis = shard_axis if shard > lay.ep else EP
            add(experts_axis, "all_reduce", 4 * n_experts, 1 if n_experts else 0, "gradient norm of the experts")
        if tp > 1:
            add("tp", "all_reduce", 4 * n_grads, 1, "gradient norm")

    if pp > 1:
        message = lay.micro_batch * seq_len * cfg.d_model * stream // tp
        sends = _remote_neighbours(pp, lay.stages_per_rank, lay.schedule, stage)
        add("pp", "send", message, micro * sends, "PP: activations forward, gradients backward")
        add("pp", "recv", message, micro * sends, "PP: activations and gradients received")
        add("pp", "broadcast", 4, batches if loop else 0, "PP: loss from the last stage")
        add("pp", "all_reduce", 4, 1, "gradient norm over stages")
        if cfg.tie_embeddings and any(first or last for _, first, last in units):
            add(
                "pp" if pp == 2 else "other",
                "all_reduce",
                cfg.vocab_size * cfg.d_model // tp // ds * dt.reduce,
                1,
                "tied embedding gradient",
            )
    return out


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
