"""The fixed order in which parallelisms are applied to a model. Each step's position is a constraint."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dist.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_dist.parallel.context import ContextParallelSpec, apply_context_parallel
from lightning_dist.parallel.data import apply_fsdp
from lightning_dist.parallel.expert import ExpertParallelSpec, apply_expert_fsdp, apply_expert_parallel
from lightning_dist.parallel.float8 import apply_float8, check_float8_collectives, float8_tp_styles
from lightning_dist.parallel.lora import adapter_plan
from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.parallel.tensor import TensorParallelPlan, apply_tensor_parallel, expand_plan
from lightning_dist.parallel_dims import ParallelDims


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    tp_plan: TensorParallelPlan | None = None,
    cp_spec: ContextParallelSpec | None = None,
    ep_spec: ExpertParallelSpec | None = None,
    fsdp_units: Sequence[nn.Module] = (),
    fsdp_roots: Sequence[nn.Module] | None = None,
    fsdp_ignored: Sequence[nn.Parameter] = (),
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> Parallelized:
    """Apply float8, EP, TP, CP, activation checkpointing, compile, then FSDP2 / replication to ``module`` (a stage or
    a model).

    The one composition path: the whole-model layouts and every pipeline stage go through it, so a step added here
    applies to both. Weights tied before stay tied after, or it raises.

    Args:
        module: The module to parallelize; plan patterns are relative to it.
        dims: The layout; its mesh must be built.
        options: How each axis works: float8, the cp attention, activation checkpointing, compile and CPU offload
            are read here.
        tp_plan: Pattern -> style; required when ``dims.tp > 1``.
        cp_spec: The module's attention functions and position tables; required when ``dims.cp > 1``.
        ep_spec: The module's experts (and their token counts); required when the module has MoE blocks and
            ``dims.ep > 1`` or ``dims.tp > 1``.
        fsdp_units: The model's blocks, in execution order: float8 converts their linear layers, activation
            checkpointing applies to them, and FSDP2 wraps each as its own unit.
        fsdp_roots: Modules wrapped after the units, picking up the remaining parameters; ``None`` = each child of
            ``module`` holding parameters outside the units (a LightningModule itself is never wrapped).
        fsdp_ignored: Parameters FSDP2 leaves whole on every rank (the module's ``unsharded_parameters()``).
        param_dtype: FSDP2 compute dtype (bf16 for mixed precision).
        reshard_after_forward: See :func:`lightning_dist.parallel.data.apply_fsdp` (pipeline stages: ``False``).

    Returns:
        What was applied: the tensor-parallel style of each module, the context-parallel attention, expert
        parallelism, float8, and the FSDP2 units by name.
    """
    mesh = dims.mesh
    ties = shared_parameters(module)
    applied: dict[str, str] = {}
    # 0. float8 first (torchtitan's order): the blocks' nn.Linear become torchao's Float8Linear, which TP shards with
    #    its float8 styles and FSDP2 all-gathers in float8 (tensorwise); their weights stay the high-precision ones.
    float8 = ""
    if options.float8 != "off":
        float8 = apply_float8(fsdp_units, options.float8, mesh.device_type, fsdp=dims.dp_cp_enabled)
    # 0b. Expert parallelism before TP: the experts become DTensors on (ep, tp) and their forward dispatches tokens, so
    #     TP's "replicate what the plan leaves" passes them by; before FSDP2, which shards them further (step 4).
    experts = ""
    if ep_spec is not None:
        experts = apply_expert_parallel(module, ep_spec, dims)
    elif dims.ep_enabled:
        raise ValueError(
            f"ep={dims.ep} needs the module's expert_parallel_spec() (its experts modules); define it on the "
            "LightningModule (a model with MoE blocks), or set ep=1."
        )
    # 1. Tensor parallelism: it turns weights into DTensors on the tp axis, which FSDP2 then shards
    #    further along dp (a 2-D DTensor). FSDP2 cannot be undone to let TP go second.
    if dims.tp_enabled:
        if not tp_plan:
            raise ValueError(
                f"tp={dims.tp} needs a tensor-parallel plan: pass plan= to the strategy or define "
                "tensor_parallel_plan() on the LightningModule."
            )
        styles = expand_plan(module, tp_plan)
        if options.float8 != "off":
            check_float8_collectives(options, mesh["tp"])
            styles = float8_tp_styles(module, styles, options.float8)
        # Low-rank adapters (LoRA) take the styles their base layer's style implies (parallel/lora.py).
        applied = apply_tensor_parallel(module, mesh["tp"], adapter_plan(module, styles))
        retie(module, ties)
    # 1b. Context parallelism: it changes no parameter (only the attention function and the position tables), so
    #     it composes with TP in either order; before compile, so the compiled blocks call the cp attention.
    context = ""
    if dims.cp_enabled:
        if cp_spec is None:
            raise ValueError(
                f"cp={dims.cp} needs the module's context_parallel_spec() (its attention modules and position "
                "tables); define it on the LightningModule, or set cp=1."
            )
        context = apply_context_parallel(module, cp_spec, mesh["cp"], options.cp_attention, options.cp_rotate)
    # 2. Activation checkpointing: after TP so the recomputation re-runs the parallelized layers, before FSDP2 so
    #    FSDP's hooks stay outside the checkpointed forward and all-gather the parameters again for it.
    # 3. torch.compile per block: after TP / AC so the graphs hold the sharded layers and the recomputation, before
    #    FSDP2 so its all-gather / reduce-scatter hooks stay outside them. In place (Module.compile), so module and
    #    parameter names, hence plans and checkpoints, do not change; one block's graph serves every block.
    #    (ParallelOptions.check refused compile with tp before any rank started.)
    apply_block_options(fsdp_units, options)
    # 4. FSDP2 / replication last, over the data-parallel axes and cp (cp ranks hold the same parameters; under
    #    DiLoCo dp_shard (x cp) only, a size-1 mesh at dp_shard=cp=1: parameters stay DTensors either way, so
    #    checkpoints and clipping take one path).
    names = {id(child): name for name, child in module.named_modules()}
    wrapped: list[str] = []
    if dims.dp_cp_enabled:
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(options.reduce_dtype or "")
        if dims.ep_enabled and ep_spec is not None:
            # The experts first, each its own unit over the ranks holding the same experts (the blocks' units then
            # leave their parameters alone).
            wrapped += apply_expert_fsdp(
                module,
                ep_spec,
                dims,
                param_dtype=param_dtype,
                cpu_offload=options.cpu_offload,
                reshard_after_forward=reshard_after_forward,
                reduce_dtype=reduce_dtype,
            )
        # FSDP2 keeps a shared parameter one parameter only inside one unit: modules that share one are wrapped
        # together (a unit holding one is left to the root that holds the rest).
        tied = {id(module.get_parameter(group[0])) for group in ties}
        fsdp_units = [unit for unit in fsdp_units if not any(id(p) in tied for p in unit.parameters())]
        if fsdp_roots is None:
            fsdp_roots = _fsdp_roots(module, {id(unit) for unit in fsdp_units})
        roots = _group_tied(fsdp_roots, tied)
        apply_fsdp(
            fsdp_units,
            roots,
            mesh[data_parallel_axes(dims, options)],
            param_dtype=param_dtype,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=options.cpu_offload,
            reduce_dtype=reduce_dtype,
            ignored_params=fsdp_ignored,
        )
        for unit in [*fsdp_units, *roots]:
            group = unit if isinstance(unit, list) else [unit]
            wrapped.append(" + ".join(names.get(id(m), "") or "(root)" for m in group))
    check_ties_kept(module, ties)
    return Parallelized(tp_styles=applied, fsdp_units=tuple(wrapped), context=context, experts=experts, float8=float8)


def data_parallel_axes(dims: ParallelDims, options: ParallelOptions) -> tuple[str, ...]:
    """The mesh axes FSDP2 shards and reduces gradients over: ``dims.fsdp_mesh_axes``, but never ``dp_replicate``
    under DiLoCo, whose replicas must train apart (only its outer step averages them)."""
    return dims.fsdp_mesh_axes[-1:] if options.diloco else dims.fsdp_mesh_axes


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


def apply_block_options(blocks: Sequence[nn.Module], options: ParallelOptions) -> None:
    """Activation checkpointing, then ``torch.compile``, applied to each block in place (steps 2 and 3 of
    :func:`parallelize`): the part of a layout that a replicated model under Lightning's DDP takes too."""
    apply_activation_checkpointing(blocks, options.activation_checkpointing, options.ac_selective)
    if options.compile:
        compile_blocks(blocks)


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` each block in place (the default inductor backend: C++ / OpenMP on CPU, Triton on GPU), as
    one whole graph (``fullgraph=True``: a graph break in a block is an error, not a silent slow path): regional
    compilation, one graph shared by every block of the same code and shapes."""
    if not blocks:
        raise ValueError(
            "compile=true compiles the model's blocks one by one: define pipeline_spec() on the module (its "
            "blocks_attr names them), or set compile=false."
        )
    for block in blocks:
        block.compile(fullgraph=True)


def shared_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one parameter (tied weights, e.g. an embedding and an output head)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(module: nn.Module, ties: list[list[str]]) -> None:
    """Make each tied group one parameter again where tensor parallelism gave its copies the same layout.

    Styles replace each module's parameters, so a weight shared by an embedding (rowwise: vocab rows sharded) and
    a head (colwise: the same vocab rows sharded) comes out as two DTensors with one layout; registering the first
    on every user keeps them one parameter, whose gradient sums both uses as in one process.
    """
    for group in ties:
        params = [module.get_parameter(name) for name in group if _has_parameter(module, name)]
        layouts = {(getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ())), p.shape) for p in params}
        if len(params) < 2 or len(layouts) != 1:
            continue  # left for check_ties_kept to report
        for name in group[1:]:
            if _has_parameter(module, name):
                parent, _, leaf = name.rpartition(".")
                (module.get_submodule(parent) if parent else module).register_parameter(leaf, params[0])


def check_ties_kept(module: nn.Module, ties: list[list[str]]) -> None:
    """Raise when parallelizing turned one shared parameter into several: the copies would train apart."""
    for group in ties:
        present = [name for name in group if _has_parameter(module, name)]
        if len({id(module.get_parameter(name)) for name in present}) > 1:
            raise ValueError(
                f"{' and '.join(present)} are one parameter (tied weights), but parallelizing (tensor parallelism / "
                "FSDP2) made separate ones of them that would train apart; untie them in the model, or leave both "
                "modules out of the tensor-parallel plan (replicated, they stay one parameter)."
            )


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


def _has_parameter(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
    except AttributeError:  # a part a pipeline stage does not hold
        return False
    return True


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
