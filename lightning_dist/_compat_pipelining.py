"""The private parts of ``torch.distributed.pipelining`` lightning-dist touches, and where torch 2.11 and 2.13 differ
(the pipelining part of ``_compat.py``, which re-exports these names: callers write ``_compat.reshape_pipeline``).

The same rule covers both files (``tests/unit/test_private_apis.py``). Each difference is found by what the installed
torch has, not by its version:

- 2.13 infers the stages' shapes again on a switch between training and eval; 2.11 keeps the first mode's receive
  buffers (:func:`follow_train_eval_switch`), and both keep them across a change of batch shape
  (:func:`reshape_pipeline`, which on 2.11 must also drop the shapes each stage cached).
- 2.11's first stage checks the strides of its inputs against the contiguous ones its shape inference recorded
  (:func:`stage_inputs`).
- 2.13's ``step`` / ``eval`` pass ``loss_kwargs`` to the loss; 2.11's have no such parameter
  (:func:`schedule_loss_kwargs`).
- 2.11's first step warms up each stage's links with a send to and a receive from each neighbour stage, its own rank
  too where a V schedule holds both, which gloo refuses ("Pair is not connected"); 2.13 skips those
  (:func:`pipeline_stage`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

#: ``PipelineStage`` methods a schedule calls for each unit of work (not a documented extension point of torch).
PIPELINE_STAGE_CHUNKS: tuple[str, ...] = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

# Single-stage schedules keep their stage and flags under "_stage", multi-stage ones under "_stages" (2.11 to 2.13).
_PREFIXES = ("_stage", "_stages")


def pipeline_stage(
    module: nn.Module, stage_index: int, num_stages: int, device: torch.device, group: dist.ProcessGroup | None
) -> PipelineStage:
    """``PipelineStage(module, stage_index, num_stages, device, group=group)``, its shapes inferred at the first run.

    On torch 2.11 its warm-up (``_get_init_p2p_neighbors_ops``) leaves out the links to its own rank: a V schedule's
    neighbour stages on one rank hand activations over in memory, and gloo cannot send to its own rank. 2.13 warms up
    by another protocol (``_warmup_forward_vote``) that passes same-rank neighbours their values directly.
    """
    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(module, stage_index, num_stages, device, group=group)
    if not hasattr(stage, "_warmup_forward_vote") and hasattr(stage, "_get_init_p2p_neighbors_ops"):
        warmup_ops = stage._get_init_p2p_neighbors_ops

        def ops_to_other_ranks() -> list[dist.P2POp]:
            return [op for op in warmup_ops() if op.group_peer != stage.group_rank]

        stage._get_init_p2p_neighbors_ops = ops_to_other_ranks
    return stage


def wrap_stage_chunks(stage: PipelineStage, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each of ``stage``'s chunk methods (:data:`PIPELINE_STAGE_CHUNKS`) by ``wrap(method)`` on the object."""
    for name in PIPELINE_STAGE_CHUNKS:
        setattr(stage, name, wrap(getattr(stage, name)))


@contextmanager
def pipeline_outputs_only(schedule: Any) -> Iterator[None]:
    """Run a pipeline schedule's ``eval()`` for its last stage's outputs alone, computing no loss.

    ``eval()`` calls the schedule's loss function on every microbatch whenever the schedule has one (it then needs
    targets); the private ``_loss_fn`` is what ``_maybe_compute_loss`` checks (2.11 and 2.13).
    """
    loss_fn, schedule._loss_fn = schedule._loss_fn, None
    try:
        yield
    finally:
        schedule._loss_fn = loss_fn


def reshape_pipeline(schedule: Any) -> None:
    """Make ``schedule`` infer its stages' activation shapes again at its next ``step`` / ``eval``.

    torch infers them (and sizes every receive buffer) on the first call only: a later batch of another shape would
    be received into the old buffers. Resetting the schedule's flags is enough for 2.13; 2.11's stages also keep the
    shapes they inferred (``inputs_meta``, and ``_outputs_meta``, which refuses to be set twice) and skip inference
    while those are set.
    """
    for prefix in _PREFIXES:
        if hasattr(schedule, f"{prefix}_forward_initialized"):
            setattr(schedule, f"{prefix}_forward_initialized", False)
            setattr(schedule, f"{prefix}_backward_initialized", False)
    for stage in _stages(schedule):
        if hasattr(stage, "inputs_meta") and hasattr(stage, "_outputs_meta"):  # torch 2.11's stage
            stage.inputs_meta = None
            stage._outputs_meta = None


def follow_train_eval_switch(schedule: Any, has_backward: bool) -> None:
    """Before a ``step`` (``has_backward=True``) or an ``eval``: set the stages up again when the last call was of the
    other kind, as torch 2.13 does itself (``_initialize_pp_stages``).

    torch 2.11 sets the receive buffers up once, for the first call's kind: a validation sanity check before training
    leaves them without ``requires_grad``, so the first training step sends no input gradient back ("has gradients
    None and is expecting to send gradients").
    """
    if hasattr(schedule, "_initialize_pp_stages"):
        return  # torch 2.13: the schedule follows the switch itself
    for prefix in _PREFIXES:
        forward_ready = getattr(schedule, f"{prefix}_forward_initialized", False)
        if forward_ready and getattr(schedule, f"{prefix}_backward_initialized", False) != has_backward:
            reshape_pipeline(schedule)
            return


def stage_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The first stage's positional inputs as the schedule must get them: tensors contiguous.

    torch 2.11's first stage compares each microbatch's strides with those its shape inference recorded, which are
    contiguous (``.to("meta")`` drops a view's strides): ``batch[:, :-1]`` would fail with "stride mismatch". A
    contiguous tensor costs one copy of the token ids, and nothing on 2.13, which checks shapes only.
    """
    return tuple(arg.contiguous() if hasattr(arg, "contiguous") else arg for arg in args)


@contextmanager
def schedule_loss_kwargs(schedule: Any, loss_kwargs: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """The keyword arguments of ``schedule.step`` / ``eval`` that make it call ``loss_fn(outputs, target,
    **loss_kwargs)`` for every microbatch (``loss_kwargs`` unchanged, e.g. a masked batch's token normalizer).

    torch 2.13's ``step`` takes ``loss_kwargs``; 2.11's has no such parameter (it would hand them to the first stage as
    model inputs), so its private ``_loss_fn`` is bound to them for the call instead.
    """
    if not loss_kwargs:
        yield {}
        return
    if "loss_kwargs" in inspect.signature(schedule.step).parameters:
        yield {"loss_kwargs": loss_kwargs}
        return
    loss_fn = schedule._loss_fn
    schedule._loss_fn = functools.partial(loss_fn, **loss_kwargs)
    try:
        yield {}
    finally:
        schedule._loss_fn = loss_fn


def _stages(schedule: Any) -> list[Any]:
    stage = getattr(schedule, "_stage", None)
    return [stage] if stage is not None else list(getattr(schedule, "_stages", []))


#: ``PipelineStage`` methods that infer a stage's input and output metadata by running its forward (and backward) on
#: empty tensors of the batch's shapes (torch 2.13, private): on the first step and after a change of shapes.
PIPELINE_METADATA_INFERENCE: tuple[str, ...] = ("_forward_metadata_inference", "_backward_metadata_inference")


def infers_stage_shapes_on_real_tensors() -> bool:
    """Whether torch's ``PipelineStage`` infers its shapes by running the stage on real (empty) tensors of the batch's
    shapes (2.13: :data:`PIPELINE_METADATA_INFERENCE`), rather than on meta tensors (2.11's ``_shape_inference``), on
    which a stage whose forward exchanges data (expert parallelism's all-to-all) cannot run."""
    from torch.distributed.pipelining import PipelineStage

    return all(hasattr(PipelineStage, name) for name in PIPELINE_METADATA_INFERENCE)


def around_pipeline_metadata_inference(stage: PipelineStage, around: Callable[[], Any]) -> None:
    """Run ``stage``'s metadata inference (:data:`PIPELINE_METADATA_INFERENCE`) inside the context ``around()``: its
    forward and backward run the model on empty tensors, which must leave no trace in the model's state (the MoE
    routers' token counts)."""
    for name in PIPELINE_METADATA_INFERENCE:
        original = getattr(stage, name, None)
        if original is None:
            continue

        def inferring(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            with around():
                return _original(*args, **kwargs)

        setattr(stage, name, inferring)
