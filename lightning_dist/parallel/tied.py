"""Tied weights: one parameter used by several modules (an input embedding tied to the output head), kept one.

Inside a module (:func:`shared_parameters`, :func:`retie`, :func:`check_ties_kept`): tensor parallelism replaces each
module's parameters, so a tied pair comes out as two DTensors; they are made one again where their layouts agree, and
a layout that splits them is refused. Across pipeline stages (:class:`StageTie`):

In one process a tied weight is one parameter whose gradient sums both uses. Split over pipeline stages, each
stage's rank holds its own copy; they stay one parameter in effect when the copies start equal (broadcast from the
first owner), their gradients are summed over the owners every step (Megatron's embedding group), and the gradient
norm counts the weight once. Each owner's optimizer then makes the same update. No Lightning, no model code here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallel.pipeline import PipelineSpec, stage_ids
from lightning_dist.parallel_dims import ParallelDims


@dataclass
class StageTie:
    """One weight shared across stages, as this rank sees it."""

    names: list[str]
    """Its names in the (unsplit) model."""
    owners: list[int]
    """The pipeline ranks holding a copy, lowest first."""
    group: dist.ProcessGroup | None = None
    """This rank's group of owners (same coordinates on every other axis); None where this rank holds no copy."""
    params: list[nn.Parameter] = field(default_factory=list)
    """This rank's copy (one object, however many of the names it holds)."""


def stage_of_name(spec: PipelineSpec, keys: Sequence[str], groups: Sequence[Sequence[int]]) -> Callable[[str], int]:
    """``name -> stage`` for a parameter name of the model; ``-1`` for parts every stage keeps."""
    prefix = f"{spec.blocks_attr}." if spec.blocks_attr else ""
    stage_of_block = {prefix + keys[i]: stage for stage, group in enumerate(groups) for i in group}
    last = len(groups) - 1

    def stage_of(name: str) -> int:
        for block, stage in stage_of_block.items():
            if name.startswith(block + "."):
                return stage
        if any(name == part or name.startswith(part + ".") for part in spec.first):
            return 0
        if any(name == part or name.startswith(part + ".") for part in spec.last):
            return last
        return -1

    return stage_of


def find_stage_ties(
    ties: list[list[str]], stage_of: Callable[[str], int], dims: ParallelDims, stages_per_rank: int, schedule: str
) -> list[StageTie]:
    """The tied groups whose users sit on stages of different pipeline ranks."""
    owner_of_stage = {
        sid: pp_rank for pp_rank in range(dims.pp) for sid in stage_ids(pp_rank, dims.pp, stages_per_rank, schedule)
    }
    found = []
    for names in ties:
        owners = sorted({owner_of_stage[stage] for stage in map(stage_of, names) if stage >= 0})
        if len(owners) > 1:
            found.append(StageTie(names, owners))
    return found


def create_groups(stage_ties: list[StageTie], dims: ParallelDims, global_rank: int) -> None:
    """One process group per tie and per coordinate of the other axes; every rank creates all, in the same order."""
    rank_of = {tuple(dims.coordinates(rank).values()): rank for rank in range(dims.world_size)}
    mine = dims.coordinates(global_rank)
    others = sorted({coords[1:] for coords in rank_of})  # coordinates without pp (pp is the first axis)
    for tie in stage_ties:
        for rest in others:
            ranks = [rank_of[(owner, *rest)] for owner in tie.owners]
            group = dist.new_group(ranks)
            if mine["pp"] in tie.owners and tuple(mine.values())[1:] == rest:
                tie.group = group


def bind(stage_ties: list[StageTie], model: nn.Module) -> None:
    """Find this rank's copy of each tie in its (pruned) ``model``, and make the copies equal to the first owner's."""
    for tie in stage_ties:
        held = {}
        for name in tie.names:
            try:
                param = model.get_parameter(name)
            except AttributeError:  # a part this rank does not hold
                continue
            held[id(param)] = param
        tie.params = list(held.values())
        if tie.group is not None and tie.params:
            with torch.no_grad():
                dist.broadcast(_local(tie.params[0]), group=tie.group, group_src=0)


def sum_grads(stage_ties: list[StageTie]) -> None:
    """Sum each tied weight's gradient over its owners: every copy gets the one-process gradient."""
    for tie in stage_ties:
        for param in tie.params:
            if tie.group is not None and param.grad is not None:
                dist.all_reduce(_local(param.grad), group=tie.group)


def counted_once(stage_ties: list[StageTie], pp_rank: int) -> set[int]:
    """Ids of this rank's tied copies the global gradient norm must skip (every owner but the first)."""
    return {id(p) for tie in stage_ties if tie.owners and pp_rank != tie.owners[0] for p in tie.params}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


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
        params = [module.get_parameter(name) for name in group if has_parameter(module, name)]
        layouts = {(getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ())), p.shape) for p in params}
        if len(params) < 2 or len(layouts) != 1:
            continue  # left for check_ties_kept to report
        for name in group[1:]:
            if has_parameter(module, name):
                parent, _, leaf = name.rpartition(".")
                (module.get_submodule(parent) if parent else module).register_parameter(leaf, params[0])


def check_ties_kept(module: nn.Module, ties: list[list[str]]) -> None:
    """Raise when parallelizing turned one shared parameter into several: the copies would train apart."""
    for group in ties:
        present = [name for name in group if has_parameter(module, name)]
        if len({id(module.get_parameter(name)) for name in present}) > 1:
            raise ValueError(
                f"{' and '.join(present)} are one parameter (tied weights), but parallelizing (tensor parallelism / "
                "FSDP2) made separate ones of them that would train apart; untie them in the model, or leave both "
                "modules out of the tensor-parallel plan (replicated, they stay one parameter)."
            )


def has_parameter(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
    except AttributeError:  # a part a pipeline stage does not hold
        return False
    return True
