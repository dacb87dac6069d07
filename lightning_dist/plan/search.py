"""Every layout a world size allows for a GPT, each estimated (:mod:`lightning_dist.plan.cost`) and ranked."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from lightning_dist.config.schema import HardwareConfig, PlanConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.parallel.options import ActivationCheckpointOptions, DiLoCoOptions, Parallelism
from lightning_dist.parallel.schedules import SCHEDULES, check_microbatches
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.cost import Estimate, estimate
from lightning_dist.plan.layout import Layout

AC_MODES = (("none", "op"), ("selective", "op"), ("selective", "op_half"), ("full", "op"))


#: Syncs and DiLoCo compressions searched when PlanConfig does not name them (its ``syncs`` /
#: ``diloco_compressions`` fields, read with these defaults until the schema has them).
SYNCS = ("every_step", "diloco")
COMPRESSIONS = ("fp32", "bf16", "int8")


def layouts(
    cfg: GPTConfig,
    world: int,
    global_batch: int,
    gpus_per_node: int,
    plan: PlanConfig,
    diloco: DiLoCoOptions | None = None,
    seq_len: int | None = None,
    context_parallel: bool = False,
    fixed: Mapping[str, Any] | None = None,
) -> Iterator[Layout]:
    """Layouts of ``world`` ranks the model and batch allow.

    - pp divides the world and the layers (at most ``plan.max_pp``); tp divides the devices of a node and the
      query and key / value heads (tp stays inside a node);
    - with ``context_parallel`` (a model the cp implementation takes: the built-in GPT, arch=llama), cp divides the
      ranks left by pp and tp, where ``seq_len`` splits into ``2 x cp`` chunks;
    - the data-parallel ranks: FSDP2 over all of them, HSDP (shard inside a node, replicate across), or replicas
      only;
    - micro batches from ``plan.micro_batches`` that divide the per-rank batch; under pp every schedule (GPipe,
      1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; 2 stages per rank for the
      multi-stage ones) where torch accepts the microbatches and the layers split evenly;
    - activation checkpointing none, selective (op: every matmul output kept; op_half: every other) and full;
    - with replicas, each sync of ``plan.syncs``: every step, or DiLoCo with the run's H, F and tau (``diloco``:
      the run's ``parallelism.diloco``) and each of ``plan.diloco_compressions``. H is not searched: it
      trades quality for speed, and larger always looks faster to a throughput model;
    - with MoE blocks, ep dividing both ``dp_shard`` and the experts (1 included: the experts FSDP2-sharded as the
      rest);
    - ``fixed``: Parallelism options every layout takes as the run sets them (``float8``, ``loss_chunks``,
      ``cpu_offload``: then only layouts with FSDP2 shards).
    """
    syncs = _syncs(plan, diloco)
    for pp in _divisors(world):
        if pp > plan.max_pp or cfg.n_layers % pp:
            continue
        for tp in _divisors(gpus_per_node):
            if (world // pp) % tp or cfg.n_heads % tp or cfg.kv_heads % tp:
                continue
            for cp in _context_degrees(cfg, world // (pp * tp), pp, seq_len, context_parallel):
                dp = world // (pp * tp * cp)
                if global_batch % dp:
                    continue
                inner = tp * cp  # ranks inside one data-parallel index: HSDP shards over the rest of a node
                per_node = gpus_per_node // inner if pp * inner <= gpus_per_node else 1
                for replicate, shard in _data_parallel(dp, per_node):
                    for ep in _expert_degrees(cfg, shard):
                        yield from _with_options(
                            cfg,
                            ParallelDims(world, replicate, shard, tp, pp, cp, ep),
                            global_batch // dp,
                            plan,
                            syncs,
                            diloco,
                            fixed or {},
                        )


def _expert_degrees(cfg: GPTConfig, dp_shard: int) -> list[int]:
    """ep degrees searched: with MoE blocks, each dividing both the experts and ``dp_shard`` (1 included)."""
    if not cfg.moe.enabled:
        return [1]
    return [ep for ep in _divisors(dp_shard) if cfg.moe.num_experts % ep == 0]


def _context_degrees(cfg: GPTConfig, ranks: int, pp: int, seq_len: int | None, enabled: bool) -> list[int]:
    """cp degrees searched: divisors of ``ranks`` whose ``2 x cp`` chunks split the sequence (1 alone without cp)."""
    if not enabled or seq_len is None or cfg.arch != "llama":
        return [1]
    return [cp for cp in _divisors(ranks) if seq_len % (2 * cp) == 0 or cp == 1]


def _with_options(
    cfg: GPTConfig,
    dims: ParallelDims,
    per_rank: int,
    plan: PlanConfig,
    syncs: list[dict[str, Any]],
    diloco: DiLoCoOptions | None,
    fixed: Mapping[str, Any],
) -> Iterator[Layout]:
    """Every micro batch, schedule, activation checkpointing and sync of one set of degrees."""
    pp, replicate = dims.pp, dims.dp_replicate
    if fixed.get("cpu_offload") and not dims.dp_cp_enabled:  # nothing sharded to offload
        return
    for micro in plan.micro_batches:
        if per_rank % micro:
            continue
        steps = per_rank // micro  # the pipeline's microbatches, else Lightning's accumulated batches
        microbatches, accumulate = (steps, 1) if pp > 1 else (None, steps)
        for schedule, v in _schedules(cfg, pp, steps):
            for ac, selective in AC_MODES:
                diloco_ok = replicate > 1 and cfg.n_layers // pp >= _fragments(diloco) and dims.ep == 1
                for sync in syncs if diloco_ok else [{}]:  # DiLoCo over expert-parallel replicas: not written
                    options = Parallelism().with_fields(
                        schedule=schedule,
                        microbatches=microbatches,
                        stages_per_rank=v,
                        activation_checkpointing=ActivationCheckpointOptions(ac, selective),
                        **sync,
                        **fixed,
                    )
                    yield Layout(dims, options, micro, accumulate)


def rank(
    cfg: GPTConfig,
    hw: HardwareConfig,
    world: int,
    seq_len: int,
    global_batch: int,
    plan: PlanConfig,
    diloco: DiLoCoOptions | None = None,
    context_parallel: bool = False,
    fixed: Mapping[str, Any] | None = None,
) -> list[Estimate]:
    """Every layout estimated, those that fit first, each group by tokens/s per device (best first; on a tie,
    synchronous before DiLoCo, whose replicas drift apart between outer steps). ``context_parallel``: also search
    cp (the model is one the cp implementation takes); ``fixed``: options every layout takes (float8, loss_chunks)."""
    found = [
        estimate(cfg, lay, hw, seq_len, global_batch)
        for lay in layouts(cfg, world, global_batch, hw.gpus_per_node, plan, diloco, seq_len, context_parallel, fixed)
    ]
    return sorted(found, key=lambda e: (not e.fits, -e.tokens_per_sec_per_device, e.layout.diloco, e.memory.total))


def _syncs(plan: PlanConfig, diloco: DiLoCoOptions | None) -> list[dict[str, Any]]:
    """The Parallelism options of each sync searched (``{}``: every step)."""
    out: list[dict[str, Any]] = []
    for sync in plan.syncs:
        if sync == "every_step":
            out.append({})
        elif sync == "diloco":
            for compression in plan.diloco_compressions:
                out.append({"sync": "diloco", "diloco": replace(diloco or DiLoCoOptions(), compression=compression)})
        else:
            raise ValueError(f"plan.syncs has {sync!r}; use every_step and / or diloco.")
    return out


def _fragments(diloco: DiLoCoOptions | None) -> int:
    """DiLoCo fragments: a pipeline rank needs a block for each."""
    return diloco.fragments if diloco is not None else 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_parallel(dp: int, per_node: int) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) choices: FSDP2 over all, HSDP sharding inside a node, replicas only."""
    options = [(1, dp)]
    if 1 < per_node < dp and dp % per_node == 0:
        options.append((dp // per_node, per_node))
    if dp > 1:
        options.append((dp, 1))
    return options


def _schedules(cfg: GPTConfig, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """Every ``torch.distributed.pipelining`` schedule the strategy runs, with 1 or 2 stages per rank, where torch
    accepts the microbatches and the layers split evenly into the stages."""
    if pp == 1:
        return [("1F1B", 1)]
    options = []
    for name, fixed in SCHEDULES.items():
        v = fixed or 2
        if cfg.n_layers % (pp * v):
            continue
        try:
            check_microbatches(name, microbatches, pp, v)
        except ValueError:
            continue
        options.append((name, v))
    return options
