"""What a module declares to the layout, read once from its hooks and passed whole.

:func:`lightning_dist.contract.declared` reads a LightningModule's optional hooks (its tensor-parallel plan, its
context- and expert-parallel specs, its blocks, the parameters FSDP2 must leave whole, its pipeline spec, how it
initializes itself) into one :class:`Declared`, checked against the degrees; :func:`~lightning_dist.parallel.compose.
parallelize` and the pipeline take that object as it is, so a new axis adds a field here, not a parameter to every
function on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.expert import ExpertParallelSpec
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.parallel.tensor import TensorParallelPlan


@dataclass(frozen=True)
class Declared:
    """A module's parts as the layout sees them (all optional; each axis that needs one checks it is there)."""

    name: str = "the module"
    """The module's class name, for messages."""
    tp_plan: TensorParallelPlan | None = None
    """Module-name pattern -> tensor-parallel style (``tp > 1``)."""
    cp_spec: ContextParallelSpec | None = None
    """Its attention modules and position tables (``cp > 1``)."""
    ep_spec: ExpertParallelSpec | None = None
    """Its MoE experts (a model with MoE blocks)."""
    blocks: tuple[nn.Module, ...] = ()
    """The blocks, in execution order: float8 converts their linear layers, activation checkpointing and compile apply
    to them, and FSDP2 wraps each as its own unit."""
    unsharded: tuple[nn.Parameter, ...] = ()
    """Frozen parameters FSDP2 leaves whole on every rank (``unsharded_parameters()``)."""
    pipeline_spec: PipelineSpec | None = None
    """How the model splits into stages (``pp > 1``)."""
    reset_parameters: Callable[[], None] | None = None
    """Gives every parameter its one-process value once materialized from the meta device."""

    def expert_load(self) -> Sequence[Tensor]:
        """The routers' token counts (the experts' ``load``), summed over the data-parallel ranks each step."""
        spec = self.ep_spec
        return list(spec.load()) if spec is not None and spec.load is not None else []
