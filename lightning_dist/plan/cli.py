"""``lightning-dist-plan``: rank the layouts of a training job before renting the machines.

A Hydra app over the training configs, so a plan composes exactly as the run would::

    lightning-dist-plan model=llama_70b cluster=slurm cluster.num_nodes=32 hardware=h100_sxm data.seq_len=8192
    lightning-dist-plan recipe=llama_8b_slurm_2x8_h100 plan.format=json > plan.json
    lightning-dist-plan model=llama_8b cluster.num_nodes=2 plan.trace=true    # + one traced rank of the best layout
    lightning-dist-plan model=llama_8b hardware=h100_ethernet_100gbps plan.tokens=1e12 plan.price_per_gpu_hour=2.5
                                                    # the cost curve: sync vs DiLoCo for each GPU count

The world is ``cluster.num_nodes`` x the devices of a node (``cluster.devices`` on a GPU cluster config, else
``hardware.gpus_per_node``); the batch is ``data.global_batch_size`` samples of ``data.seq_len`` tokens (with the
synthetic data, a built-in model's ``max_seq_len`` unless ``data.seq_len`` is given; one line says which). The table
(120 columns) ranks the synchronous layouts, then apart the DiLoCo ones, which change the math. ``--help``: the app's
own (``lightning_dist/run/help.py``).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich import box
from rich.console import Console
from rich.table import Table

from lightning_dist.config.build import planned_model
from lightning_dist.config.schema import CONF_DIR, TrainConfig, register_configs, to_train_config
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.plan.collectives import per_axis, step_collectives
from lightning_dist.plan.cost import ASSUMPTIONS, Estimate, stage_params
from lightning_dist.plan.cost_curve import Row, cost_curve, duration, short
from lightning_dist.plan.experts import expert_collectives
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.memory import GIB
from lightning_dist.plan.savings import option_effects
from lightning_dist.plan.search import rank
from lightning_dist.plan.trace import RankTrace, trace_rank

register_configs()


def main() -> None:
    """Console-script entry point (no run folder: a plan writes nothing)."""
    sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    _hydra_main()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(raw: DictConfig) -> None:
    try:
        cfg = to_train_config(raw)
        hydra_cfg = HydraConfig.get()
        given = {override.lstrip("+~").split("=", 1)[0] for override in hydra_cfg.overrides.task}
        note = adopt_model_seq_len(cfg, "data.seq_len" in given, hydra_cfg.runtime.choices.get("recipe") is not None)
        if note is not None:
            print(note, file=sys.stderr, flush=True)  # stderr: plan.format=json keeps stdout JSON
        plan(cfg)
    except ValueError as err:
        sys.exit(f"error: {err}")


def adopt_model_seq_len(cfg: TrainConfig, given: bool, recipe: bool) -> str | None:
    """The synthetic data's ``data.seq_len`` (a test setting: 128) is not what a plan of a model is about: a built-in
    model's plan takes its ``model.max_seq_len`` unless ``data.seq_len`` is given (or a recipe sets it); a
    HuggingFace model's keeps it (its context may be far longer than it trains on). Returns the line that says which
    length is planned (``None``: the one given)."""
    if given or recipe or getattr(cfg.data, "kind", None) != "synthetic":
        return None
    if isinstance(cfg.model, GPTConfig) and cfg.model.max_seq_len != cfg.data.seq_len:
        cfg.data.seq_len = cfg.model.max_seq_len
        return f"planning data.seq_len={cfg.data.seq_len}: the model's max_seq_len (set data.seq_len to plan another)"
    return (
        f"planning data.seq_len={cfg.data.seq_len}: the synthetic data's default (set data.seq_len to the length you "
        "will train on)"
    )


def world_of(cfg: TrainConfig) -> int:
    """Ranks of the planned job (see the module docstring)."""
    per_node = cfg.cluster.devices if cfg.cluster.accelerator != "cpu" else cfg.hardware.gpus_per_node
    return cfg.cluster.num_nodes * per_node


def plan(cfg: TrainConfig) -> list[Estimate]:
    """Estimate and rank every layout of ``cfg``'s job; print the table (or JSON) and, with ``plan.trace``, a traced
    rank of the best layout. The synchronous layouts come first (one process's math), then the DiLoCo ones (their
    replicas train apart between outer steps: another loss curve), each in the search's order.

    Raises:
        ValueError: The model is not the built-in GPT, or the format is unknown.
    """
    context_parallel = context_parallel_ok(cfg)  # before the model becomes its GPT shape
    cfg = replace(cfg, model=planned_model(cfg.model))  # a Llama-family model=hf is planned as its GPT shape
    if cfg.plan.format not in ("table", "json"):
        raise ValueError(f"plan.format={cfg.plan.format!r} is unknown; use table or json.")
    world, seq_len, batch = world_of(cfg), cfg.data.seq_len, cfg.data.global_batch_size
    tokens = cfg.plan.tokens
    if tokens is not None:
        price = cfg.plan.price_per_gpu_hour
        rows = cost_curve(
            cfg.model, cfg.hardware, seq_len, batch, cfg.plan, float(tokens), price, cfg.parallelism.diloco
        )
        if cfg.plan.format == "json":
            print(json.dumps([row.to_json() for row in rows], indent=1))
        else:
            _print_cost_curve(cfg, rows, float(tokens), price)
        return [point.estimate for row in rows for point in (row.sync, row.diloco) if point is not None]
    par = cfg.parallelism  # every layout: the run's float8, loss_chunks and cpu_offload
    fixed = {"float8": par.float8, "loss_chunks": par.loss_chunks, "cpu_offload": par.fsdp.cpu_offload}
    found = rank(
        cfg.model,
        cfg.hardware,
        world,
        seq_len,
        batch,
        cfg.plan,
        cfg.parallelism.diloco,
        context_parallel,
        fixed,
    )
    if not found:
        raise ValueError(
            f"no layout of {world} ranks divides data.global_batch_size={batch} and the model; change the batch or "
            "the number of nodes."
        )
    found.sort(key=lambda e: e.layout.diloco)  # apart: DiLoCo changes the math (rank's order kept in each group)
    if cfg.plan.format == "json":
        print(json.dumps([e.to_json() for e in found], indent=1))
        return found
    _print_table(cfg, world, found)
    if cfg.plan.trace:
        _print_trace(cfg, found[0])
    return found


def context_parallel_ok(cfg: TrainConfig) -> bool:
    """Whether the run could use cp: the built-in GPT with arch=llama on unmasked text (the pre-launch checks of
    ``config/validate.py`` refuse the rest: HuggingFace models, gpt2, instruction / chat losses)."""
    model = cfg.model
    text = getattr(cfg.data, "format", "text") not in ("instruction", "chat")
    return isinstance(model, GPTConfig) and model.arch == "llama" and text


#: The terminal width of the plan's output.
WIDTH = 120


def _print_table(cfg: TrainConfig, world: int, found: list[Estimate]) -> None:
    """The layouts that keep one process's math (synchronous replicas), then apart the DiLoCo ones, whose replicas
    train apart between outer steps (another loss curve): each group fitting first, best first."""
    hw = cfg.hardware
    console = Console(width=WIDTH)
    fitting = [e for e in found if e.fits]
    console.print(
        f"{len(fitting)} of {len(found)} layouts fit: {world} x {hw.name}, {cfg.data.global_batch_size} x "
        f"{cfg.data.seq_len} tokens per step"
    )
    groups = (
        ("synchronous (every step: one process's math)", [e for e in found if not e.layout.diloco]),
        ("DiLoCo (replicas train apart between outer steps: the math changes)", [e for e in found if e.layout.diloco]),
    )
    for title, group in groups:
        shown = (group if cfg.plan.show_all else [e for e in group if e.fits])[: cfg.plan.top]
        if group:
            console.print(_layout_table(title, shown, diloco=group[0].layout.diloco))
    best = next((e for e in found if e.fits and not e.layout.diloco), None)
    if best is not None:
        for line in option_effects(cfg.model, hw, cfg.data.seq_len, cfg.data.global_batch_size, best):
            console.print(f"best synchronous layout with {line}")
    _print_device(console, cfg)


def _layout_table(title: str, shown: list[Estimate], diloco: bool) -> Table:
    """One group's rows (at most 120 columns: the degrees in one column, the exposed communication wrapped)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    columns = ["#", "degrees", "schedule", "m x mb", "AC"]
    columns += ["DiLoCo"] if diloco else []
    columns += ["GiB", "tok/s/dev", "MFU", "bubble", "exposed comm ms (axis)", "fits"]
    for column in columns:  # every column its natural width but the communication's, which takes what is left
        left = column in ("schedule", "AC", "DiLoCo", "exposed comm ms (axis)")
        left = left or column == "degrees"
        table.add_column(column, justify="left" if left else "right", no_wrap=not column.startswith("exposed"))
    for i, e in enumerate(shown, 1):
        lay = e.layout
        exposed = {axis: round(c["exposed_s"] * 1e3) for axis, c in e.comm.items() if axis != "world"}
        comm = ", ".join(f"{ms} {axis}" for axis, ms in exposed.items() if ms) or "-"  # the axes that cost a ms
        row = [
            str(i),
            _degrees(lay),
            f"{lay.schedule} v{lay.stages_per_rank}" if lay.pp > 1 else "-",
            f"{lay.microbatches} x {lay.micro_batch}",
            lay.ac if lay.ac != "selective" else lay.ac_selective,
        ]
        row += [_diloco_cell(lay)] if diloco else []
        row += [
            f"{e.memory.total / GIB:.1f}",
            f"{e.tokens_per_sec_per_device:,.0f}",
            f"{e.mfu:.1%}",
            f"{e.bubble_fraction:.2f}",
            comm,
            "yes" if e.fits else "no",
        ]
        table.add_row(*row)
    return table


def _degrees(lay: Layout) -> str:
    """The degrees above 1, and the data-parallel ranks as replicas x shards: ``pp2 tp2 dp 2x4``."""
    model = " ".join(
        f"{axis}{degree}"
        for axis, degree in (("pp", lay.pp), ("tp", lay.tp), ("cp", lay.cp), ("ep", lay.ep))
        if degree > 1
    )
    return f"{model} dp {lay.dp_replicate}x{lay.dp_shard}".strip()


def _diloco_cell(lay: Layout) -> str:
    """``H=50 int8`` (with ``F=`` and ``tau=`` when streaming)."""
    o = lay.options.diloco
    streaming = (f" F={o.fragments}" if o.fragments > 1 else "") + (f" tau={o.delay}" if o.delay else "")
    return f"H={o.every} {o.compression}{streaming}"


def _print_cost_curve(cfg: TrainConfig, rows: list[Row], tokens: float, price: float | None) -> None:
    hw = cfg.hardware
    params = stage_params(cfg.model, 1) / 1e9
    table = Table(
        title=f"{params:.1f}B parameters, {tokens:.3g} tokens, {cfg.data.global_batch_size} x "
        f"{cfg.data.seq_len} tokens per step, {hw.name}, {hw.inter_node_gbps:g} GB/s per GPU between nodes"
        + (f", ${price:g} per GPU-hour" if price else "")
    )
    for column in (
        "GPUs",
        "sync: best layout",
        "tok/s",
        "time",
        "cost",
        "DiLoCo: best layout",
        "tok/s",
        "time",
        "cost",
        "DiLoCo / sync",
    ):
        table.add_column(column, justify="left" if "layout" in column else "right")
    for row in rows:
        cells = [str(row.gpus)]
        for point in (row.sync, row.diloco):
            if point is None:
                cells += [short(point), "-", "-", "-"]
                continue
            cost = "-" if point.cost is None else f"${point.cost:,.0f}"
            cells += [short(point), f"{point.tokens_per_sec:,.0f}", duration(point.hours), cost]
        both = row.sync and row.diloco
        cells.append(f"{row.diloco.tokens_per_sec / row.sync.tokens_per_sec:.2f}x" if both else "-")
        table.add_row(*cells)
    console = Console(width=WIDTH)
    console.print(table)
    console.print(
        "time = tokens / (tokens/s per GPU x GPUs); cost = time in hours x price per GPU-hour x GPUs; "
        "DiLoCo's loss at the same tokens is not modelled (see docs/planner.md)"
    )
    _print_device(console, cfg)


def _print_device(console: Console, cfg: TrainConfig) -> None:
    hw = cfg.hardware
    console.print(
        f"device: {hw.name}, {hw.peak_tflops} TFLOP/s bf16 at {hw.compute_efficiency:.0%}, {hw.memory_gib} GiB "
        f"({hw.context_gib} for the CUDA context), {hw.gpus_per_node} per node, {hw.intra_node_gbps} GB/s inside a "
        f"node, {hw.inter_node_gbps} GB/s between nodes"
    )
    for line in ASSUMPTIONS:
        console.print(f"assumed: {line}")


def apply_layout(cfg: TrainConfig, lay: Layout) -> TrainConfig:
    """``cfg`` set to run ``lay`` (the parallelism fields and the micro batch), e.g. to trace or train it."""
    # The planner's replicas are the mesh strategy's (FSDP2 on a (dp_replicate, dp_shard=1) mesh), not Lightning's DDP.
    strategy = "pipeline_parallel" if lay.pp > 1 else ("tensor_parallel" if lay.tp > 1 else "fsdp")
    par = replace(
        cfg.parallelism,
        strategy=strategy,
        dp_replicate=lay.dp_replicate,
        dp_shard=lay.dp_shard,
        tp=lay.tp,
        pp=lay.pp,
        cp=lay.cp,
        ep=lay.ep,
        pipeline=lay.options.pipeline,
        activation_checkpointing=lay.options.activation_checkpointing,
    )
    per_node = cfg.cluster.devices if cfg.cluster.accelerator != "cpu" else cfg.hardware.gpus_per_node
    cluster = replace(cfg.cluster, devices=per_node, accelerator="cpu", precision="bf16-mixed")
    return replace(cfg, parallelism=par, cluster=cluster, data=replace(cfg.data, micro_batch_size=lay.micro_batch))


def _print_trace(cfg: TrainConfig, best: Estimate) -> None:
    lay = best.layout
    traced = _trace(apply_layout(cfg, lay), step=lay.pp == 1, memory=cfg.plan.trace_memory)
    memory = best.memory
    analytic = memory.params // 4
    print(f"traced rank 0 of the best layout on the fake backend ({lay.describe()}):")
    error = (traced.local_params - analytic) / analytic
    print(f"  parameters {traced.local_params:,}, analytic {analytic:,} ({error:+.2%})")
    if traced.collectives is None:
        print("  (a pipeline rank: traced for its parameters only, not stepped)")
        return
    parts = [
        ("gradient bytes", traced.grad_bytes, memory.grads),
        ("optimizer bytes", traced.optimizer_bytes, memory.optimizer),
    ]
    if traced.peak_bytes:  # the planner's total without its allocator margin
        parts.append(("peak bytes (MemTracker)", traced.peak_bytes, int(memory.total / (1 + memory.margin))))
    for name, got, want in parts:
        print(f"  {name} {got:,}, analytic {want:,} ({(got - want) / want:+.2%})")
    seq = cfg.data.seq_len
    planned = per_axis(
        step_collectives(cfg.model, lay, seq, "bf16-mixed", stage=0, loop=False)
        + expert_collectives(cfg.model, lay, seq, "bf16-mixed", stage=0)
    )
    for axis in sorted(set(planned) | set(traced.collectives)):
        got, want = traced.collectives.get(axis, {}), planned.get(axis, {})
        print(
            f"  comm/{axis}: traced {got.get('bytes', 0):,} bytes in {got.get('calls', 0)} calls, "
            f"analytic {want.get('bytes', 0):,} bytes in {want.get('calls', 0)} calls"
        )


def _trace(cfg: TrainConfig, step: bool, memory: bool) -> RankTrace:
    """Rank 0 of ``cfg``'s layout traced in a fresh process: tracing makes this process a rank of the fake process
    group, and a plan's own process stays free of it (spawned: nothing of this process's state is inherited)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(trace_rank, cfg, 0, step=step, memory=memory).result()


if __name__ == "__main__":
    main()
