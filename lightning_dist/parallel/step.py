"""One training step, stage by stage, as plain functions: the only place the step is written.

1. :func:`local_step_args`: this cp rank's part of the batch (``cp > 1``: every tensor whose dim 1 is the sequence
   is cut head-tail; :func:`~lightning_dist.parallel.context.shard_batch`).
2. Forward and backward under loss parallelism (:func:`loss_context`): the whole model's loss and its backward, or
   under ``pp > 1`` the pipeline schedule, which runs both inside the loss and hands its gradients back after.
   Accumulating micro steps reduce no gradients (:func:`no_gradient_sync`). :func:`forward_backward` is this stage
   in one call, for callers without Lightning's loop.
3. :func:`finish_gradients`: the MoE routers' load summed over the data-parallel ranks, gradients left as partial
   sums reduced (TP), averaged over the fault-tolerant replica groups (torchft), the norm over every axis, clipping.
4. :func:`optimizer_step`: the replica groups' commit (torchft), the non-finite guard's decision (on the device where
   the optimizer can take it), the inner step, then DiLoCo's outer step.

Under ``parallelism.replicas.recovery=torchft`` a step starts by joining the replica groups' quorum
(:meth:`~lightning_dist.parallel.replicas.FaultTolerantReplicas.begin_step`, before stage 2).

:class:`~lightning_dist.strategies.mesh.MeshStrategy` calls them from its Lightning hooks in this order
(``training_step``: 1, 2; ``backward``: 2; ``optimizer_step``: 3, 4), ``DataParallelStrategy`` calls 3 and 4, and the
planner's trace (:mod:`lightning_dist.plan.trace`) and measurement (:mod:`lightning_dist.plan.measure`) call 1-3.
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from lightning_dist.parallel.clip import clip_grad_norm_
from lightning_dist.parallel.context import gather_outputs, sequence_length, shard_batch
from lightning_dist.parallel.diloco import DiLoCo
from lightning_dist.parallel.guard import NonFiniteGuard
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline_stages import PipelineStages
from lightning_dist.parallel.replicas import FaultTolerantReplicas
from lightning_dist.parallel.tensor import reduce_partial_grads
from lightning_dist.parallel_dims import ParallelDims


# ------------------------------------------------------------------------------------------- 1. the local batch
def local_batch(batch: Any, dims: ParallelDims) -> Any:
    """This rank's part of ``batch``: its cp chunks of every sequence (the batch itself at ``cp = 1``)."""
    if not dims.cp_enabled:
        return batch
    return shard_batch(batch, dims.cp, dims.mesh["cp"].get_local_rank())


def local_step_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], dims: ParallelDims
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A step hook's arguments with its batch (the first positional argument, or ``batch=``) cut for this cp rank."""
    if not dims.cp_enabled:
        return args, kwargs
    if args:
        return (local_batch(args[0], dims), *args[1:]), kwargs
    if "batch" in kwargs:
        return args, {**kwargs, "batch": local_batch(kwargs["batch"], dims)}
    return args, kwargs


def whole_predictions(outputs: Any, batch: Any, dims: ParallelDims) -> Any:
    """``predict_step`` outputs of this cp rank's part made whole again: those whose dim 1 is the local length are
    gathered over cp (the outputs themselves at ``cp = 1``, or for a batch without a sequence)."""
    seq_len = sequence_length(batch) if dims.cp_enabled else None
    if seq_len is None:
        return outputs
    return gather_outputs(outputs, seq_len // dims.cp, dims.mesh["cp"].get_group())


# ------------------------------------------------------------------------------------ 2. forward and backward
def loss_context(dims: ParallelDims, options: Parallelism) -> AbstractContextManager[None]:
    """Loss parallelism (``tp > 1`` with ``tensor.loss_parallel``): the cross-entropy on vocab-sharded logits. It must
    wrap the loss's forward and its backward."""
    return loss_parallel() if options.tensor.loss_parallel and dims.tp_enabled else nullcontext()


@contextmanager
def no_gradient_sync(model: nn.Module) -> Generator[None, None, None]:
    """No gradient reduction on accumulating micro steps: FSDP2 keeps unsharded gradients until the last one."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def forward_backward(
    compute_loss: Callable[[Any], Tensor],
    batch: Any,
    dims: ParallelDims,
    options: Parallelism,
    *,
    pipeline: PipelineStages | None = None,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> Tensor:
    """Stages 1 and 2 in one call: this rank's part of ``batch``, its loss and the gradients of it.

    Args:
        compute_loss: The module's loss of a batch (``module.compute_loss``); under ``pp > 1`` the schedule's.
        batch: The whole (data-parallel rank's) micro batch.
        dims: The layout.
        options: How each axis works.
        pipeline: This rank's stages (``pp > 1``): the schedule runs forward and backward inside the loss.
        forward_context: What the forward runs inside: the precision's autocast (Lightning's
            ``precision_plugin.forward_context``), a measurement's hooks.

    Returns:
        The loss (the mean over microbatches under ``pp > 1``, the same on every pipeline rank).
    """
    batch = local_batch(batch, dims)
    if pipeline is not None:
        with forward_context(), loss_context(dims, options):
            loss = pipeline.compute_loss(batch)
        pipeline.restore_grads()
        return loss
    with forward_context(), loss_context(dims, options):
        loss = compute_loss(batch)
    with loss_context(dims, options):
        loss.backward()
    return loss


# ------------------------------------------------------------------------------------------ 3. the gradients
def sum_expert_load(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum the MoE routers' token counts over ``group`` (the ranks holding other tokens of the step: data-parallel
    and cp ranks; tp and pp peers count the same tokens) in one all-reduce, in place, with no read back to the host,
    so the module's ``on_before_optimizer_step`` balances the experts by the global batch's load."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(summed.view_as(tensor))


def finish_gradients(
    parameters: Iterable[nn.Parameter],
    clip: float | None = None,
    *,
    expert_load: Sequence[Tensor] = (),
    load_group: dist.ProcessGroup | None = None,
    pipeline: PipelineStages | None = None,
    replicas: FaultTolerantReplicas | None = None,
) -> Tensor:
    """The step's whole gradient (every micro batch in) made ready for the optimizer; returns its norm.

    Args:
        parameters: The model's parameters (this rank's shards and stages).
        clip: Scale the gradients so their norm over every axis is at most this; ``None``: only measure it.
        expert_load: The routers' token counts to sum over ``load_group`` first (empty: nothing to sum).
        load_group: The ranks with other tokens of the step; ``None``: every rank.
        pipeline: This rank's stages: the norm sums over the pipeline ranks, a weight tied across stages counted once.
        replicas: The fault-tolerant replica groups (torchft): the gradients averaged over those in the quorum.

    Returns:
        The gradient norm over every axis, the same on every rank (a device tensor: nothing is read to the host).
    """
    parameters = list(parameters)
    sum_expert_load(expert_load, load_group)
    reduce_partial_grads(parameters)  # once, not again in every op that reads them
    if replicas is not None:  # after FSDP2's reduction inside the group: HSDP's replica all-reduce, through torchft
        replicas.average_gradients(parameters)
    pp_group = pipeline.pp_group if pipeline is not None else None
    exclude = pipeline.norm_exclude if pipeline is not None else frozenset()
    return clip_grad_norm_(parameters, clip, pp_group, norm_exclude=exclude)


# ------------------------------------------------------------------------------------------ 4. the update
def optimizer_step(
    apply: Callable[[], Any],
    optimizer: Any,
    norm: Tensor,
    loss: Any,
    *,
    guard: NonFiniteGuard,
    step: int,
    report: bool,
    on_device: bool,
    diloco: DiLoCo | None = None,
    replicas: FaultTolerantReplicas | None = None,
) -> Any:
    """The inner optimizer step ``apply`` unless the guard drops it, then DiLoCo's count (and its outer step when
    one is due). A step the optimizer skips on the device (``found_inf``) still counts: knowing it would cost a host
    read every step.

    Args:
        apply: The optimizer step (Lightning's, with its hooks).
        optimizer: Its optimizer.
        norm: The step's gradient norm (:func:`finish_gradients`).
        loss: The step's loss, for the guard's message.
        guard: The non-finite guard.
        step: The optimizer step's number (1-based).
        report: A logging step: the guard reads its device-side record.
        on_device: The guard decides on the device (:meth:`NonFiniteGuard.decides_on_device`).
        diloco: DiLoCo's outer loop (``sync=diloco``), else ``None``.
        replicas: The fault-tolerant replica groups: the step is applied only when they all commit it.

    Raises:
        NonFiniteError: ``resilience.on_nonfinite=stop`` and a non-finite step was found.
    """
    if replicas is not None and not replicas.should_commit():
        if getattr(optimizer, "optimizer", None) is not None:  # a LightningOptimizer
            optimizer = optimizer.optimizer
        optimizer.zero_grad(set_to_none=True)  # a group in the quorum failed the step: no group applies it
        return loss
    if diloco is None:
        inner = apply
    else:

        def inner() -> Any:
            result = apply()
            diloco.after_inner_step()
            return result

    return guard.optimizer_step(optimizer, norm, loss, inner, step=step, report=report, on_device=on_device)
