"""The fixed order in which parallelisms are applied to a model or a pipeline stage. Each step's position is a
constraint, said where the step is taken."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dist.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_dist.parallel.context import apply_context_parallel
from lightning_dist.parallel.data import apply_fsdp
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.expert import apply_expert_fsdp, apply_expert_parallel
from lightning_dist.parallel.float8 import apply_float8, check_float8_collectives, float8_tp_styles
from lightning_dist.parallel.lora import adapter_plan
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.tensor import apply_tensor_parallel, expand_plan
from lightning_dist.parallel.tied import check_ties_kept, retie, shared_parameters
from lightning_dist.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` applied to a module (module names relative to it)."""

    tp_styles: dict[str, str] = field(default_factory=dict)
    """Module name -> tensor-parallel style applied (``ColwiseParallel``, ...)."""
    fsdp_units: tuple[str, ...] = ()
    """The FSDP2 units, in the order they were wrapped (``"a + b"``: modules sharing a parameter, one unit)."""
    context: str = ""
    """What context parallelism runs, in words; empty at ``cp=1``."""
    experts: str = ""
    """What expert parallelism runs, in words; empty without it."""
    float8: str = ""
    """What float8 training runs (recipe, converted layers), in words; empty without it."""


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    options: Parallelism,
    declared: Declared,
    *,
    param_dtype: torch.dtype | None = None,
    stage: bool = False,
) -> Parallelized:
    """Apply float8, EP, TP, CP, activation checkpointing, compile, then FSDP2 / replication to ``module``.

    The one composition path: whole models and every pipeline stage go through it, so a step added here applies to
    both. Weights tied before stay tied after, or it raises.

    Args:
        module: The model or pipeline stage to parallelize; plan patterns and spec names are relative to it.
        dims: The layout; its mesh must be built.
        options: How each axis works.
        declared: What the module declares (its plan, specs, blocks, unsharded parameters), for this module.
        param_dtype: FSDP2's compute dtype (bf16 under mixed precision), from the Trainer's precision.
        stage: ``module`` is a pipeline stage: FSDP2 wraps it whole after its blocks, and keeps parameters gathered
            between a step's microbatches (a stage runs forward once per microbatch).

    Returns:
        What was applied: the tensor-parallel style of each module, the context-parallel attention, expert
        parallelism, float8, and the FSDP2 units by name.
    """
    ties = shared_parameters(module)
    # 0. float8 first (torchtitan's order): the blocks' nn.Linear become torchao's Float8Linear, which TP shards with
    #    its float8 styles and FSDP2 all-gathers in float8 (tensorwise); their weights stay the high-precision ones.
    float8 = ""
    if options.float8 != "off":
        float8 = apply_float8(declared.blocks, options.float8, dims.mesh.device_type, fsdp=dims.dp_cp_enabled)
    # 0b. Expert parallelism before TP: the experts become DTensors on (ep, tp) and their forward dispatches tokens, so
    #     TP's "replicate what the plan leaves" passes them by; before FSDP2, which shards them further (step 4).
    experts = _apply_expert_parallel(module, dims, declared)
    # 1. Tensor parallelism: it turns weights into DTensors on the tp axis, which FSDP2 then shards further along dp
    #    (a 2-D DTensor). FSDP2 cannot be undone to let TP go second.
    styles = _apply_tensor_parallel(module, dims, options, declared, ties)
    # 1b. Context parallelism: it changes no parameter (only the attention function and the position tables), so it
    #     composes with TP in either order; before compile, so the compiled blocks call the cp attention.
    context = _apply_context_parallel(module, dims, options, declared)
    # 2. Activation checkpointing: after TP so the recomputation re-runs the parallelized layers, before FSDP2 so
    #    FSDP's hooks stay outside the checkpointed forward and all-gather the parameters again for it.
    # 3. torch.compile per block: after TP / AC so the graphs hold the sharded layers and the recomputation, before
    #    FSDP2 so its all-gather / reduce-scatter hooks stay outside them. In place (Module.compile), so module and
    #    parameter names, hence plans and checkpoints, do not change; one block's graph serves every block.
    #    (Parallelism.check refused compile with tp before any rank started.)
    apply_block_options(declared.blocks, options)
    # 4. FSDP2 / replication last, over the data-parallel axes and cp (cp ranks hold the same parameters; under
    #    DiLoCo dp_shard (x cp) only, a size-1 mesh at dp_shard=cp=1: parameters stay DTensors either way, so
    #    checkpoints and clipping take one path).
    units = (
        _apply_data_parallel(module, dims, options, declared, ties, param_dtype, stage) if dims.dp_cp_enabled else ()
    )
    check_ties_kept(module, ties)
    return Parallelized(tp_styles=styles, fsdp_units=units, context=context, experts=experts, float8=float8)


def _apply_expert_parallel(module: nn.Module, dims: ParallelDims, declared: Declared) -> str:
    if declared.ep_spec is not None:
        return apply_expert_parallel(module, declared.ep_spec, dims)
    if dims.ep_enabled:
        raise ValueError(
            f"ep={dims.ep} needs the module's expert_parallel_spec() (its experts modules); define it on the "
            "LightningModule (a model with MoE blocks), or set ep=1."
        )
    return ""


def _apply_tensor_parallel(
    module: nn.Module, dims: ParallelDims, options: Parallelism, declared: Declared, ties: list[list[str]]
) -> dict[str, str]:
    if not dims.tp_enabled:
        return {}
    if not declared.tp_plan:
        raise ValueError(
            f"tp={dims.tp} needs a tensor-parallel plan: pass plan= to the strategy or define "
            "tensor_parallel_plan() on the LightningModule."
        )
    styles = expand_plan(module, declared.tp_plan)
    if options.float8 != "off":
        check_float8_collectives(options, dims.mesh["tp"])
        styles = float8_tp_styles(module, styles, options.float8)
    # Low-rank adapters (LoRA) take the styles their base layer's style implies (parallel/lora.py).
    applied = apply_tensor_parallel(module, dims.mesh["tp"], adapter_plan(module, styles))
    retie(module, ties)
    return applied


def _apply_context_parallel(module: nn.Module, dims: ParallelDims, options: Parallelism, declared: Declared) -> str:
    if not dims.cp_enabled:
        return ""
    if declared.cp_spec is None:
        raise ValueError(
            f"cp={dims.cp} needs the module's context_parallel_spec() (its attention modules and position tables); "
            "define it on the LightningModule, or set cp=1."
        )
    return apply_context_parallel(module, declared.cp_spec, dims.mesh["cp"], options.context)


def _apply_data_parallel(
    module: nn.Module,
    dims: ParallelDims,
    options: Parallelism,
    declared: Declared,
    ties: list[list[str]],
    param_dtype: torch.dtype | None,
    stage: bool,
) -> tuple[str, ...]:
    """FSDP2 over the data-parallel axes (step 4 of :func:`parallelize`): the experts, the blocks, then the roots
    that hold the remaining parameters. Returns the units by name."""
    names = {id(child): name for name, child in module.named_modules()}
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(options.fsdp.reduce_dtype or "")
    # A stage runs forward once per microbatch; resharding would all-gather the same parameters again.
    reshard_after_forward = not stage
    wrapped: list[str] = []
    if dims.ep_enabled and declared.ep_spec is not None:
        # The experts first, each its own unit over the ranks holding the same experts (the blocks' units then leave
        # their parameters alone).
        wrapped += apply_expert_fsdp(
            module,
            declared.ep_spec,
            dims,
            param_dtype=param_dtype,
            cpu_offload=options.fsdp.cpu_offload,
            reshard_after_forward=reshard_after_forward,
            reduce_dtype=reduce_dtype,
        )
    # FSDP2 keeps a shared parameter one parameter only inside one unit: modules that share one are wrapped together
    # (a unit holding one is left to the root that holds the rest).
    tied = {id(module.get_parameter(group[0])) for group in ties}
    units = [unit for unit in declared.blocks if not any(id(p) in tied for p in unit.parameters())]
    roots = [module] if stage else _fsdp_roots(module, {id(unit) for unit in units})
    grouped = _group_tied(roots, tied)
    apply_fsdp(
        units,
        grouped,
        dims.mesh[data_parallel_axes(dims, options)],
        param_dtype=param_dtype,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=options.fsdp.cpu_offload,
        reduce_dtype=reduce_dtype,
        ignored_params=declared.unsharded,
    )
    for unit in [*units, *grouped]:
        group = unit if isinstance(unit, list) else [unit]
        wrapped.append(" + ".join(names.get(id(m), "") or "(root)" for m in group))
    return tuple(wrapped)


def data_parallel_axes(dims: ParallelDims, options: Parallelism) -> tuple[str, ...]:
    """The mesh axes FSDP2 shards and reduces gradients over: ``dims.fsdp_mesh_axes``, but never ``dp_replicate``
    under DiLoCo, whose replicas must train apart (only its outer step averages them)."""
    return dims.fsdp_mesh_axes[-1:] if options.diloco_enabled else dims.fsdp_mesh_axes


def apply_block_options(blocks: Sequence[nn.Module], options: Parallelism) -> None:
    """Activation checkpointing, then ``torch.compile``, applied to each block in place (steps 2 and 3 of
    :func:`parallelize`): the part of a layout that a replicated model under Lightning's DDP takes too."""
    apply_activation_checkpointing(blocks, options.activation_checkpointing)
    if options.compile:
        compile_blocks(blocks)


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` each block in place (the default inductor backend: C++ / OpenMP on CPU, Triton on GPU), as
    one whole graph (``fullgraph=True``: a graph break in a block is an error, not a silent slow path): regional
    compilation, one graph shared by every block of the same code and shapes."""
    if not blocks:
        raise ValueError(
            "parallelism.compile=true compiles the model's blocks one by one: define pipeline_spec() on the module "
            "(its blocks_attr names them), or set parallelism.compile=false."
        )
    for block in blocks:
        block.compile(fullgraph=True)


def _group_tied(roots: Sequence[nn.Module], tied: set[int]) -> list[nn.Module | list[nn.Module]]:
    """``roots`` with every set of modules that share a parameter merged into one list (one FSDP2 unit)."""
    groups: list[list[nn.Module]] = []
    for root in roots:
        shared = {id(p) for p in root.parameters()} & tied
        matches = [group for group in groups if shared & {id(p) for m in group for p in m.parameters()}]
        merged = [root]
        for group in matches:
            groups.remove(group)
            merged = group + merged
        groups.append(merged)
    return [group[0] if len(group) == 1 else group for group in groups]


def _fsdp_roots(module: nn.Module, unit_ids: set[int]) -> list[nn.Module]:
    """The modules below ``module`` that own every parameter outside the units: its children, looking through
    ``nn.ModuleDict`` / ``nn.ModuleList`` (FSDP2 wraps only modules with a ``forward``).

    Raises:
        ValueError: ``module`` holds parameters itself; left out of FSDP2 they would never be synchronized.
    """
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters directly ({', '.join(own)}), which data parallelism cannot "
            "shard or synchronize here; move them into a submodule (e.g. an nn.Module attribute that uses them)."
        )
    roots: list[nn.Module] = []
    for child in module.children():
        if id(child) in unit_ids or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            roots.extend(_fsdp_roots(child, unit_ids))
        else:
            roots.append(child)
    return roots
