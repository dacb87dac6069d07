"""Expert parallelism's traffic from the model's shapes: the all-to-alls of :mod:`lightning_dist.parallel.expert`.

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
from lightning_dist.plan.collectives import Collective, Dtypes, recomputed_blocks
from lightning_dist.plan.layout import Layout, stage_split

INT64 = 8


def moe_blocks_of_stage(cfg: GPTConfig, layout: Layout, stage: int) -> int:
    """MoE blocks pipeline rank ``stage`` holds (the first ``moe.dense_layers`` blocks of the model are dense)."""
    total = layout.pp * layout.options.stages_per_rank
    if total == 1:
        return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    split = stage_split(cfg, total)
    mine = stage_ids(stage, layout.pp, layout.options.stages_per_rank, layout.schedule)
    return sum(cfg.is_moe_layer(i) for sid in mine for i in split[sid])


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
