"""One rank of a real-size layout, traced on this machine: the model on the meta device, torch's fake process-group
backend for the world, and the strategies' own layout path (:func:`~lightning_dist.parallel.lay_out.lay_out`: TP,
CP, activation checkpointing, FSDP2, pipeline split). Nothing is allocated and no collective runs; what the rank would
hold is read from its shards' shapes.

With ``step=True`` the rank then runs one optimizer step on fake tensors (``FakeTensorMode``: shapes and dtypes
only) through the step's own functions (:mod:`lightning_dist.parallel.step`): every micro batch's forward and
backward, the gradients finished as in training (the experts' load, partial sums, the norm), and AdamW, with the
telemetry's :class:`~lightning_dist.telemetry.comm.CommTracker` counting each collective it issues on the fake
backend. Lightning's loop is not run, so its per-batch scalars (:func:`~lightning_dist.plan.collectives.
step_collectives` with ``loop=False``) are not in the trace.

Run it in a fresh process (it initializes ``torch.distributed``): ``lightning-dist-plan plan.trace=true`` spawns one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

from lightning_dist import _compat, contract
from lightning_dist.config.build import build_module
from lightning_dist.config.schema import TrainConfig
from lightning_dist.config.validate import build_parallel_dims, split_batch
from lightning_dist.parallel import step
from lightning_dist.parallel.data import param_dtype_of
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.expert import ExpertDispatch
from lightning_dist.parallel.lay_out import lay_out
from lightning_dist.parallel.pipeline_stages import PipelineStages
from lightning_dist.parallel_dims import REPORTED_AXIS, ParallelDims
from lightning_dist.telemetry.comm import CommTracker, axis_groups_from_mesh
from lightning_dist.telemetry.throughput import model_state_bytes


@dataclass(frozen=True)
class RankTrace:
    """What one rank holds after parallelizing: its parameters (local shards) and its pipeline stages."""

    rank: int
    coordinates: dict[str, int]
    local_params: int
    param_bytes: int
    stage_ids: list[int]
    microbatches: int | None
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    collectives: dict[str, dict[str, int]] | None = None  # axis -> {"bytes", "calls"}, per optimizer step
    peak_bytes: int = 0  # the step's peak of live tensors (torch's MemTracker), when traced with memory=True


def trace_rank(
    cfg: TrainConfig, rank: int, step: bool = False, memory: bool = False, states: bool = False
) -> RankTrace:
    """Parallelize ``cfg``'s model as rank ``rank`` of its full world size would, without allocating it.

    The layout comes from ``cfg`` exactly as for training (``cluster.devices x cluster.num_nodes`` ranks); the data
    is not read, so a recipe naming files that are not on this machine traces too. ``step``: also run one
    optimizer step on fake tensors and count its collectives, gradients and optimizer state. ``memory``: also
    follow every tensor the step creates with torch's ``MemTracker`` and report the peak of what is alive (slower:
    minutes for an 8B model). ``states``: without a step, build the gradients (zeros) and AdamW's state on fake
    tensors and count them: a layout whose step cannot run on fake tensors (expert parallelism reads its split sizes
    back to the host) or a pipeline rank.
    """
    dims = build_parallel_dims(cfg)
    per_rank = cfg.data.global_batch_size // dims.dp_size
    split = split_batch(cfg, dims, per_rank)
    par = replace(cfg.parallelism, pipeline=replace(cfg.parallelism.pipeline, microbatches=split.microbatches))
    cfg = replace(cfg, parallelism=par, data=replace(cfg.data, micro_batch_size=split.micro_batch_size))
    _compat.init_fake_process_group(rank, dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")
        module = build_module(cfg)
        _compat.set_device_mesh(None, module, mesh)
        with torch.device("meta"):
            module.configure_model()
        declared = contract.declared(module, dims, par)
        laid = lay_out(
            module,
            dims,
            par,
            declared,
            rank=rank,
            device=torch.device("cpu"),
            param_dtype=param_dtype_of(cfg.cluster.precision),
            materialize=False,
        )
        pipeline = laid.pipeline
        params = {id(p): p for p in module.parameters()}.values()
        extra = _fake_step(cfg, dims, module, declared, pipeline, per_rank, memory) if step else {}
        if states and not step:
            extra = _fake_states(module)
        return RankTrace(
            rank=rank,
            coordinates=dims.coordinates(rank),
            local_params=sum(_local(p).numel() for p in params),
            param_bytes=sum(_local(p).numel() * p.element_size() for p in params),
            stage_ids=pipeline.stage_ids if pipeline is not None else [0],
            microbatches=pipeline.microbatches if pipeline is not None else None,
            **extra,
        )
    finally:
        dist.destroy_process_group()


def _local(param: Any) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _fake_step(
    cfg: TrainConfig,
    dims: ParallelDims,
    module: Any,
    declared: Declared,
    pipeline: PipelineStages | None,
    per_rank: int,
    memory: bool,
) -> dict[str, Any]:
    """One optimizer step of the laid-out ``module`` on fake tensors, through the step's own functions
    (:mod:`lightning_dist.parallel.step`), its collectives counted."""
    if pipeline is not None:  # the schedule's P2P warm-up vote reads a tensor (.item()): not fakeable
        raise ValueError("plan.trace steps whole-model layouts; a pipeline rank is traced for its parameters only.")
    micro = cfg.data.micro_batch_size or per_rank
    seq = cfg.data.seq_len
    tracker = CommTracker(axis_groups_from_mesh(dims.mesh), timing=False)
    mixed = cfg.cluster.precision == "bf16-mixed"  # Lightning's autocast, as in training
    forward_context = MixedPrecision("bf16-mixed", "cpu").forward_context if mixed else contextlib.nullcontext
    with _compat.fake_tensor_mode(allow_non_fake_inputs=True), _balanced_dispatch():
        module.to_empty(device="cpu")  # fake tensors with the meta shapes: nothing is allocated
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
        vocab = module.hf_model_config.vocab_size if hasattr(module, "hf_model_config") else cfg.model.vocab_size
        tokens = torch.randint(0, vocab, (micro, seq + 1))
        batch = (tokens[:, :-1], tokens[:, 1:])
        mem = _memory_tracker(module, optimizer, step.local_batch(batch, dims)) if memory else None
        steps = per_rank // micro
        with tracker, mem if mem is not None else contextlib.nullcontext():
            for index in range(steps):
                if mem is not None and index:
                    mem.reset_mod_stats()  # it follows each module once per step; the peak is kept
                # accumulate: FSDP2 reduces on the last micro batch only, as in training
                with step.no_gradient_sync(module) if index < steps - 1 else contextlib.nullcontext():
                    step.forward_backward(
                        module.compute_loss, batch, dims, cfg.parallelism, forward_context=forward_context
                    )
            load = declared.expert_load() if dims.dp_cp_size > 1 else ()
            step.finish_gradients(
                module.parameters(),
                cfg.trainer.gradient_clip_val,
                expert_load=load,
                load_group=dims.group(dims.loss_axis) if load else None,
            )
            optimizer.step()
        states = model_state_bytes(module, [optimizer])
        peak = mem.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0) if mem is not None else 0
    collectives: dict[str, dict[str, int]] = {}
    for (axis, _op), stats in tracker.snapshot().items():
        totals = collectives.setdefault(REPORTED_AXIS.get(axis, axis), {"bytes": 0, "calls": 0})
        totals["bytes"] += stats.bytes
        totals["calls"] += stats.count
    return {
        "grad_bytes": states["grads"],
        "optimizer_bytes": states["optimizer"],
        "collectives": collectives,
        "peak_bytes": peak,
    }


@contextlib.contextmanager
def _balanced_dispatch() -> Any:
    """Expert parallelism's split sizes as a balanced routing gives them (each ep rank sends every other the same
    rows and receives as many): fake tensors hold no counts to read back to the host."""
    ExpertDispatch.balanced_splits = True
    try:
        yield
    finally:
        ExpertDispatch.balanced_splits = False


def _fake_states(module: Any) -> dict[str, int]:
    """The bytes of the gradients and AdamW's state this rank would hold: both built on fake tensors from the
    parameters' own shards (zero gradients, one AdamW step), no forward."""
    with _compat.fake_tensor_mode(allow_non_fake_inputs=True):
        module.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
        for param in module.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        states = model_state_bytes(module, [optimizer])
    return {"grad_bytes": states["grads"], "optimizer_bytes": states["optimizer"]}


def _memory_tracker(module: Any, optimizer: Any, batch: tuple[Any, ...]) -> Any:
    """torch's ``MemTracker`` following ``module``, with AdamW's state already created (a later step's peak)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mem = _compat.mem_tracker()
    mem.track_external(module, optimizer, *batch)
    return mem
