"""Expert parallelism from the model's shapes: what a rank holds of an MoE GPT (:func:`local_params`) and the
all-to-alls of :mod:`lightning_dist.parallel.expert`.

Per MoE block a rank holds, per micro batch, with ``R = micro_batch x (T / cp) x top_k / tp`` routed rows of
``d_model`` values (the tokens of its tp part, each once per chosen expert) in the compute dtype:

- forward: one all-to-all of the row counts (``num_experts`` int64), one of the rows to the ranks holding their
  experts (``R`` rows: the telemetry's size is the input's), one of the outputs back (the rows this rank received);
- backward: the two row all-to-alls reversed (the received rows' gradients, then ``R`` rows);
- a block whose forward runs again under activation checkpointing: the forward's three again.

Dropless routing makes the rows a rank *receives* depend on the routing: a rank's own count varies from step to step,
but the ep ranks of a group receive exactly the rows they send, ``R`` each on average. So these are the mean over the
ep ranks of a group: exact for that mean (``tests/distributed/test_expert_parallel.py`` checks it against the
telemetry's ``comm/ep/bytes``), and the balanced rank's count for any one rank.
"""

from __future__ import annotations

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.pipeline import stage_ids
from lightning_dist.parallel_dims import EP
from lightning_dist.plan.collectives import recomputed_blocks
from lightning_dist.plan.layout import Layout, layer_params, stage_split
from lightning_dist.plan.memory import block_params
from lightning_dist.plan.moe_memory import expert_params, expert_shard, moe_dense_params
from lightning_dist.plan.tensors import Collective, Dtypes, moe_blocks_of_stage

INT64 = 8


def expert_collectives(
    cfg: GPTConfig, layout: Layout, seq_len: int, precision: str = "bf16-mixed", stage: int = 0
) -> list[Collective]:
    """The all-to-alls on the ``ep`` axis in one optimizer step of pipeline rank ``stage`` (the mean over its ep
    group's ranks; see the module docstring); empty at ``ep = 1`` or for a dense GPT."""
    lay = layout
    if lay.dims.ep <= 1 or not cfg.moe.enabled:
        return []
    blocks = moe_blocks_of_stage(cfg, lay, stage)
    again = recomputed_blocks(lay, blocks)
    micro = lay.microbatches
    rows = lay.micro_batch * (seq_len // lay.cp) * cfg.moe.top_k / lay.tp
    size = int(rows * cfg.d_model * Dtypes.of(precision).compute)
    counts = cfg.moe.num_experts * INT64
    forwards = micro * (blocks + again)
    return [
        Collective(EP, "all_to_all", counts, forwards, "EP: tokens per expert (the split sizes)"),
        Collective(EP, "all_to_all", size, 2 * forwards, "EP: rows to their experts and back"),
        Collective(EP, "all_to_all", size, 2 * micro * blocks, "EP: the rows' gradients back and forth"),
    ]


def local_params(cfg: GPTConfig, layout: Layout) -> int:
    """Parameters the pipeline rank holding the most holds (:func:`rank_local_params`)."""
    return max(rank_local_params(cfg, layout))


def gathered_stage_params(cfg: GPTConfig, layout: Layout) -> int:
    """Parameters a pipeline rank holds gathered (FSDP2 keeps a stage's units unsharded for the whole schedule), the
    rank holding the most: its dense ones over ``tp``, its MoE blocks' ``E / ep`` experts whole."""
    lay = layout
    total = lay.pp * lay.options.pipeline.stages_per_rank
    split = stage_split(cfg, total)
    counts = []
    for rank in range(lay.pp):
        layers = [
            i for sid in stage_ids(rank, lay.pp, lay.options.pipeline.stages_per_rank, lay.schedule) for i in split[sid]
        ]
        moe = sum(cfg.is_moe_layer(i) for i in layers)
        dense = sum(layer_params(cfg, lay.pp)[i] for i in layers) - moe * expert_params(cfg)  # embedding, head too
        counts.append(int(dense / lay.tp + moe * expert_params(cfg) / lay.ep))
    return max(counts)


def rank_local_params(cfg: GPTConfig, layout: Layout) -> list[int]:
    """Parameters each pipeline rank holds, its own shards (:mod:`lightning_dist.plan.moe_memory`):
    the dense ones over ``tp x dp_shard x cp`` (norms and routers whole on every tp rank), the routed experts
    ``1 / ep`` each FSDP2-sharded over ``efsdp x cp``; FSDP2's dim-0 padding counted for the routers and experts,
    whose rows are few (the largest rank's count, the first of a group)."""
    lay, h = layout, cfg.d_model
    total = lay.pp * lay.options.pipeline.stages_per_rank
    split = stage_split(cfg, total) if total > 1 else [list(range(cfg.n_layers))]
    shard = lay.fsdp_shard
    router = -(-cfg.moe.num_experts // shard) * h  # (E, C), dim 0 padded to the FSDP2 group
    experts = expert_shard(cfg, lay.ep, lay.dp_shard, lay.cp)
    counts = []
    for rank in range(lay.pp):
        ids = stage_ids(rank, lay.pp, lay.options.pipeline.stages_per_rank, lay.schedule) if total > 1 else [0]
        layers = [i for sid in ids for i in split[sid]]
        moe = sum(cfg.is_moe_layer(i) for i in layers)
        blocks = (len(layers) - moe) * block_params(cfg) + moe * (moe_dense_params(cfg) - cfg.moe.num_experts * h)
        sharded, whole = blocks - 2 * h * len(layers), 2 * h * len(layers)  # norms: whole on every tp rank
        if 0 in ids:
            sharded += cfg.vocab_size * h
        if total - 1 in ids:
            sharded += 0 if cfg.tie_embeddings and lay.pp == 1 else cfg.vocab_size * h
            whole += h
        counts.append(sharded // (lay.tp * shard) + whole // shard + moe * (router + experts))
    return counts
