"""What a LightningModule may offer lightning-dist's strategies, written down once.

Every method is optional: a module offers what its layouts need, and a strategy that needs a missing one stops with
a message naming it. The strategies look hooks up only through :func:`module_hook`, so this Protocol is the whole
contract. The reference :class:`~lightning_dist.models.module.GPTModule` implements all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.parallel.tensor import TensorParallelPlan


@runtime_checkable
class ParallelModule(Protocol):
    """The hooks a LightningModule can define for tensor and pipeline parallelism (all optional)."""

    def compute_loss(self, batch: Any) -> Tensor:
        """Forward and loss of one batch; ``training_step`` and ``validation_step`` call it.

        Under a pipeline (``pp > 1``) the strategy replaces it on the instance with a call to the schedule, which runs
        forward and backward of every microbatch and returns the mean microbatch loss on every rank, so the module's
        own ``training_step`` (logging included) stays as it is.
        """

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
        """Module-name pattern (relative to the LightningModule) -> ``ParallelStyle`` or ``"colwise"`` /
        ``"rowwise"`` / ``"sequence"``. Needed for ``tp > 1`` unless the strategy gets ``plan=``."""

    def pipeline_spec(self) -> PipelineSpec:
        """How the model is split into stages (see :class:`PipelineSpec`). Needed for ``pp > 1``.

        Stage forward contract: a stage runs ``model.forward`` on a copy of the model whose block container holds only
        its blocks and whose ``first`` / ``last`` parts it does not own are ``None``. So ``forward`` must accept the
        previous stage's output as its input, skip each part that is ``None``, and return one tensor.
        """

    def check_tensor_parallel(self, tp: int, sequence_parallel: bool) -> None:
        """Raise a one-line ``ValueError`` naming the size and the fix when ``tp`` cannot split the model."""

    def reset_parameters(self) -> None:
        """Initialize every parameter after a strategy materialized the model from the meta device.

        Must give each parameter the value it has in one process (e.g. seeded by parameter name), whatever part of
        the model this rank holds.
        """

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU; may also be a number attribute."""


#: The hook names of :class:`ParallelModule`.
HOOKS: frozenset[str] = frozenset(
    ("compute_loss", "tensor_parallel_plan", "pipeline_spec", "check_tensor_parallel", "reset_parameters")
)


def module_hook(module: Any, name: str) -> Callable[..., Any] | None:
    """``module``'s implementation of the :class:`ParallelModule` hook ``name``, or ``None`` when it has none."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a ParallelModule hook; the hooks are {sorted(HOOKS)}.")
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def declared_blocks(module: Any) -> list[Any]:
    """The blocks a module declares through ``pipeline_spec()`` (FSDP2 wraps them one by one); [] without one."""
    from lightning_dist._compat import module_children

    spec_fn = module_hook(module, "pipeline_spec")
    if spec_fn is None:
        return []
    spec = spec_fn()
    return list(module_children(spec.blocks(spec.model(module))).values())
