"""The private parts of ``torch.distributed.pipelining`` lightning-dist touches (the pipelining part of
``_compat.py``, which re-exports these names: callers write ``_compat.reshape_pipeline``).

The same rule covers both files (``tests/unit/test_private_apis.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

#: ``PipelineStage`` methods a schedule calls for each unit of work (not a documented extension point of torch).
PIPELINE_STAGE_CHUNKS: tuple[str, ...] = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def wrap_stage_chunks(stage: PipelineStage, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each of ``stage``'s chunk methods (:data:`PIPELINE_STAGE_CHUNKS`) by ``wrap(method)`` on the object."""
    for name in PIPELINE_STAGE_CHUNKS:
        setattr(stage, name, wrap(getattr(stage, name)))


@contextmanager
def pipeline_outputs_only(schedule: Any) -> Iterator[None]:
    """Run a pipeline schedule's ``eval()`` for its last stage's outputs alone, computing no loss.

    torch 2.13's ``eval()`` calls the schedule's loss function on every microbatch whenever the schedule has one (it
    then needs targets); the private ``_loss_fn`` is what ``_maybe_compute_loss`` checks.
    """
    loss_fn, schedule._loss_fn = schedule._loss_fn, None
    try:
        yield
    finally:
        schedule._loss_fn = loss_fn


def reshape_pipeline(schedule: Any) -> None:
    """Make ``schedule`` infer its stages' activation shapes again at its next ``step`` / ``eval``.

    torch 2.13 infers them (and sizes every receive buffer) on the first call only, and again only on a switch
    between training and eval: a later batch of another shape would be received into the old buffers.
    """
    for prefix in ("_stage", "_stages"):  # single-stage / multi-stage schedules
        if hasattr(schedule, f"{prefix}_forward_initialized"):
            setattr(schedule, f"{prefix}_forward_initialized", False)
            setattr(schedule, f"{prefix}_backward_initialized", False)
