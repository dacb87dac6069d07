"""Pipeline parallelism: split a model's block sequence into stages and run them with a torch schedule.

A model is described by a :class:`PipelineSpec` (its block container, the parts owned by the first and last
stage, the loss). Splitting keeps the full model's module names: a rank deletes the blocks it does not own from
the container in place (original keys kept), so parameter names, optimizer state and checkpoints do not depend
on the split. With several stages per rank (interleaved / looped / V schedules) the rank's model holds the union
of its stages' blocks and each stage runs a *view*: a shallow clone of the model whose container holds only
that stage's blocks (the blocks themselves are shared, not copied).

No Lightning imports and no model code here; :mod:`lightning_dist.parallel.pipeline_stages`
drives it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_dist._compat import module_children, shallow_clone
from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.schedules import SCHEDULES, V_SCHEDULES

# Re-exported (pipeline.check_microbatches, .resolve_schedule: their first home); the schedules' names and rules are
# plain Python in parallel/schedules.py, which ParallelOptions (and so the launcher) checks without torch.
from lightning_dist.parallel.schedules import check_microbatches as check_microbatches
from lightning_dist.parallel.schedules import resolve_schedule as resolve_schedule


@dataclass(frozen=True)
class PipelineSpec:
    """What a LightningModule tells the pipeline strategy about its model (returned by ``pipeline_spec()``).

    Args:
        model_attr: Attribute of the LightningModule holding the model to split (GPT: ``"model"``).
        blocks_attr: Dotted path of the block container inside that model (``nn.Sequential``, ``nn.ModuleList``
            or ``nn.ModuleDict``, run in order); ``""`` = the model itself is the container.
        first: Submodule names of the model used only before the blocks (embeddings); kept on the first stage.
        last: Submodule names used only after the blocks (final norm, head); kept on the last stage.
        loss_fn: ``loss_fn(outputs, targets, **loss_kwargs) -> scalar`` loss of one microbatch, whose mean over the
            microbatches is the batch's loss (the schedule scales gradients by ``1 / microbatches``).
        split_batch: ``split_batch(batch) -> (inputs, targets)`` or ``(inputs, targets, loss_kwargs)``; ``inputs`` a
            tensor or a tuple of tensors (batch dim first), ``targets`` one tensor (the schedule cuts it along dim
            0), ``loss_kwargs`` a dict passed unchanged to ``loss_fn`` for every microbatch (e.g. the step's token
            normalization, ``{"scale": G / N}``). ``None`` = the batch is already ``(inputs, targets)``.
        stage_forward: ``stage_forward(stage_model, *inputs) -> Tensor`` run by each stage instead of the model's
            own ``forward`` (for models whose ``forward`` cannot skip the parts a stage lacks, e.g. HF's); ``None``
            = the model's ``forward``, which must then follow the stage contract (see ``ParallelModule``).
        head: Name of a ``last`` part that ``loss_fn`` applies itself rather than the last stage (a loss that never
            builds the whole logits: the stage returns the hidden states before it); calling the pipelined model
            outside a loss (validation / predict code) applies it to them, so the model's output is the same.
    """

    model_attr: str
    blocks_attr: str = ""
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    loss_fn: Callable[..., Tensor] | None = None
    split_batch: Callable[[Any], tuple[Any, ...]] | None = None
    stage_forward: Callable[..., Tensor] | None = None
    head: str | None = None

    def model(self, module: nn.Module) -> nn.Module:
        """The model to split, read from ``module`` (the LightningModule)."""
        model = getattr(module, self.model_attr, None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"pipeline_spec().model_attr={self.model_attr!r} is not an nn.Module of {type(module).__name__}; "
                "build the model in __init__ or configure_model and name its attribute."
            )
        return model

    def blocks(self, model: nn.Module) -> nn.Module:
        """The block container of ``model``."""
        container = model.get_submodule(self.blocks_attr) if self.blocks_attr else model
        if not isinstance(container, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"pipeline_spec().blocks_attr={self.blocks_attr!r} is a {type(container).__name__}; point it at an "
                "nn.Sequential, nn.ModuleList or nn.ModuleDict of blocks."
            )
        return container

    def split(self, batch: Any) -> tuple[Any, Tensor, dict[str, Any] | None]:
        """``(inputs, targets, loss_kwargs)`` of ``batch`` (``loss_kwargs`` ``None`` when ``split_batch`` gave a
        pair)."""
        split = self.split_batch(batch) if self.split_batch is not None else batch
        if not isinstance(split, (tuple, list)) or len(split) not in (2, 3):
            raise ValueError(
                f"pipeline_spec().split_batch must return (inputs, targets) or (inputs, targets, loss_kwargs); got "
                f"{type(split).__name__}{f' of {len(split)}' if isinstance(split, (tuple, list)) else ''}."
            )
        loss_kwargs = split[2] if len(split) == 3 else None
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise ValueError(
                f"the third element of pipeline_spec().split_batch's result is a {type(loss_kwargs).__name__}; it must "
                "be the dict of keyword arguments loss_fn takes (give split_batch= for a batch of three tensors)."
            )
        return split[0], split[1], loss_kwargs


# ----------------------------------------------------------------------------------------------- splitting
def block_costs(model: nn.Module, spec: PipelineSpec) -> tuple[list[str], list[float]]:
    """Block keys in order and each block's cost: its parameter count, the first / last parts added to the ends.

    The embedding and the head can be as large as several blocks (vocab x d_model), so leaving them out would put
    most of the model on the first and last stages.
    """
    blocks = module_children(spec.blocks(model))
    keys = list(blocks)
    costs = [float(_numel(blocks[key])) for key in keys]
    if keys:
        costs[0] += sum(_numel(_get_optional(model, name)) for name in spec.first)
        costs[-1] += sum(_numel(_get_optional(model, name)) for name in spec.last)
    return keys, costs


def balanced_split(costs: Sequence[float], num_stages: int) -> list[list[int]]:
    """Split consecutive blocks into ``num_stages`` non-empty groups minimizing the largest group's cost.

    Exact dynamic programme over contiguous partitions (``O(n^2 k)``, n blocks, k stages: microseconds here).
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"{num_stages} pipeline stages for {n} blocks: every stage needs a block; lower pp (or stages_per_rank) "
            f"to at most {n}, or use a model with more blocks."
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: smallest max-cost splitting the first i blocks into k groups; cut[k][i]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    groups, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        groups.append(list(range(start, end)))
        end = start
    return groups[::-1]


def split_at(keys: Sequence[str], blocks_attr: str, split_points: Sequence[str], num_stages: int) -> list[list[int]]:
    """Groups of block indices from module names that start a new stage (e.g. ``["layers.2"]``)."""
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"split_points={list(split_points)} gives {len(split_points) + 1} stages but pp x stages_per_rank = "
            f"{num_stages}; give {num_stages - 1} split point(s)."
        )
    prefix = f"{blocks_attr}." if blocks_attr else ""
    names = [prefix + key for key in keys]
    starts = []
    for point in split_points:
        if point not in names:
            raise ValueError(f"split point {point!r} is not a block; use one of {names}.")
        starts.append(names.index(point))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(f"split_points={list(split_points)} must be increasing and not the first block {names[0]!r}.")
    bounds = [0, *starts, len(keys)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_stages)]


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices rank ``pp_rank`` runs: round-robin (``r, r+p, ...``), or a V for ZBV / DualPipeV."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


# -------------------------------------------------------------------------------------------- stage modules
def prune_model(model: nn.Module, spec: PipelineSpec, keep: set[str], first: bool, last: bool) -> None:
    """Delete, in place, the blocks not in ``keep`` and the first / last parts this rank does not run.

    Container keys are left as they are (``layers.5`` stays ``layers.5``): names match the full model's.
    """
    blocks = module_children(spec.blocks(model))
    for key in list(blocks):
        if key not in keep:
            del blocks[key]
    for names, owned in ((spec.first, first), (spec.last, last)):
        if not owned:
            for name in names:
                _set_none(model, name)


def stage_view(model: nn.Module, spec: PipelineSpec, keys: Sequence[str], first: bool, last: bool) -> nn.Module:
    """A module that runs only ``keys`` of the (pruned) ``model``'s blocks, sharing their parameters.

    Clones are shallow (the module objects below the container are shared); each clone has its own dicts of
    children and hooks, so hooks put on one stage (FSDP, TP) do not fire on another.
    """
    view = shallow_clone(model)
    container = view
    for name in spec.blocks_attr.split(".") if spec.blocks_attr else ():
        children = module_children(container)
        container = children[name] = shallow_clone(children[name])
    children = module_children(container)
    for key in [key for key in children if key not in keys]:
        del children[key]
    for names, owned in ((spec.first, first), (spec.last, last)):
        if not owned:
            for name in names:
                _set_none(view, name)
    if spec.stage_forward is not None:
        view.forward = types.MethodType(spec.stage_forward, view)  # on this view only; nn.Module calls self.forward
    return view


def stage_cp_spec(module: nn.Module, cp_spec: ContextParallelSpec, model_attr: str) -> ContextParallelSpec:
    """``cp_spec`` (names relative to ``module``) for a stage view of ``module.<model_attr>``: its names relative to
    the model, its ``prepare`` run once here on the whole module (stage views share the prepared submodules)."""
    prefix = f"{model_attr}."

    def relative(name: str) -> str:
        if name != model_attr and not name.startswith(prefix):
            raise ValueError(
                f"context_parallel_spec() names {name!r}, outside the pipelined model {model_attr!r}: under pp a "
                f"stage holds only part of {model_attr}; name modules inside it, or set cp=1."
            )
        return name.removeprefix(model_attr).removeprefix(".")

    if cp_spec.prepare is not None:
        cp_spec.prepare(module)
    return dataclasses.replace(
        cp_spec,
        attention=tuple(relative(pattern) for pattern in cp_spec.attention),
        positions=None if cp_spec.positions is None else relative(cp_spec.positions),
        position_ids=None if cp_spec.position_ids is None else relative(cp_spec.position_ids),
        prepare=None,
    )


def share_buffers(view: nn.Module, model: nn.Module) -> None:
    """Point ``view``'s own buffers at ``model``'s: materializing gave the model new tensors after the view copied
    its dicts (its submodules are shared, so only its own buffers, e.g. RoPE tables, need this)."""
    for name, _ in view.named_buffers(recurse=False):
        setattr(view, name, getattr(model, name))


def build_schedule(
    name: str,
    stages: list[PipelineStage],
    microbatches: int,
    loss_fn: Callable[..., Tensor] | None,
) -> Any:
    """The torch schedule ``name`` over this rank's ``stages``.

    Gradients are scaled by ``1 / microbatches`` (torch's ``scale_grads``): with a mean loss per microbatch and
    equal microbatches, they equal the gradients of the whole batch's mean loss.
    """
    cls = get_schedule_class(name)
    if SCHEDULES[name] == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def broadcast_loss(loss: Tensor, src: int, group: dist.ProcessGroup | None) -> Tensor:
    """Send the last stage's loss to every rank of the pipeline group (``src`` is a rank within ``group``)."""
    if group is None:
        return loss
    dist.broadcast(loss, group=group, group_src=src)
    return loss


# -------------------------------------------------------------------------------------------------- helpers
def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _get_optional(model: nn.Module, name: str) -> nn.Module | None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return getattr(parent, leaf, None)


def _set_none(model: nn.Module, name: str) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    children = module_children(parent)
    if leaf not in children:
        if hasattr(parent, leaf) and getattr(parent, leaf) is None:
            return  # an optional part this model does not have (GPT's pos_emb under arch=llama)
        raise ValueError(f"pipeline_spec() names {name!r}, which is not a submodule of {type(model).__name__}.")
    children[leaf] = None
