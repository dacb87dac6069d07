"""What a LightningModule may offer lightning-dist's strategies, written down once.

Every method is optional: a module offers what its layouts need, and a strategy that needs a missing one stops with
a message naming it. The strategies look hooks up only through :func:`module_hook`, so this Protocol is the whole
contract. The reference :class:`~lightning_dist.models.module.GPTModule` implements all of it.

The other way round, :class:`MeshStrategyView` is what the telemetry, data and checkpoint code read from a strategy
beyond Lightning's own ``Strategy`` API; they look it up only through :func:`strategy_view`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import get_protocol_members

from lightning_dist._compat import module_children
from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.data import repeated_blocks
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.expert import ExpertParallelSpec, check_expert_parallel
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.parallel.pipeline_stages import PipelineStages
from lightning_dist.parallel.tensor import TensorParallelPlan
from lightning_dist.parallel_dims import ParallelDims


@runtime_checkable
class ParallelModule(Protocol):
    """The hooks a LightningModule can define for tensor, pipeline and context parallelism (all optional)."""

    def compute_loss(self, batch: Any) -> Tensor:
        """Forward and loss of one batch; ``training_step`` and ``validation_step`` call it.

        Under a pipeline (``pp > 1``) the strategy runs the module's ``training_step`` / ``validation_step`` /
        ``test_step`` on a view of the module whose ``compute_loss`` calls the schedule (the instance itself is not
        changed), which runs forward and backward of every microbatch and returns the mean microbatch loss on every
        rank, so the module's own step (logging included) stays as it is.
        """

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> TensorParallelPlan:
        """Module-name pattern (relative to the LightningModule) -> ``ParallelStyle`` or ``"colwise"`` /
        ``"rowwise"`` / ``"sequence"``. Needed for ``tp > 1`` unless the strategy gets ``plan=``."""

    def pipeline_spec(self) -> PipelineSpec:
        """How the model is split into stages (see :class:`PipelineSpec`). Needed for ``pp > 1``.

        Stage forward contract: a stage runs ``model.forward`` on a copy of the model whose block container holds only
        its blocks and whose ``first`` / ``last`` parts it does not own are ``None``. So ``forward`` must accept the
        previous stage's output as its input, skip each part that is ``None``, and return one tensor.

        Batch and loss contract: ``split_batch(batch)`` returns ``(inputs, targets)`` or ``(inputs, targets,
        loss_kwargs)``; the schedule cuts ``inputs`` and ``targets`` (one tensor) into microbatches along dim 0 and
        calls ``loss_fn(outputs, targets, **loss_kwargs)`` for each, with ``loss_kwargs`` unchanged (the built-in GPT
        and ``HFCausalLM`` pass the step's token normalization ``{"scale": G / N}`` of masked data this way). The
        step's loss is the mean of the microbatch losses.
        """

    def check_tensor_parallel(self, tp: int, sequence_parallel: bool) -> None:
        """Raise a one-line ``ValueError`` naming the size and the fix when ``tp`` cannot split the model."""

    def context_parallel_spec(self) -> ContextParallelSpec:
        """Which modules hold the attention function and which buffers are per-position tables (see
        :class:`~lightning_dist.parallel.context.ContextParallelSpec`). Needed for ``cp > 1``.

        Batch contract: the strategy gives each cp rank its part of every batch tensor whose dim 1 is the sequence
        length (dim 1 of the batch's first tensor of two or more dims), before ``training_step`` / ``validation_step``
        / ``test_step`` / ``predict_step``; tensors of any other shape arrive whole. The gradients of the cp ranks are
        averaged, so a loss that is a mean over this rank's tokens is the one-process loss when every cp rank counts
        as many tokens (no ``-100`` targets); a loss normalized by a count over the whole batch must be multiplied by
        ``cp``. ``predict_step`` outputs whose dim 1 is the local length are gathered back to the whole sequence.
        """

    def check_context_parallel(self, cp: int) -> None:
        """Raise a one-line ``ValueError`` naming the reason and the fix when ``cp`` cannot split the model."""

    def expert_parallel_spec(self) -> ExpertParallelSpec | None:
        """Where the model's MoE experts are (see :class:`~lightning_dist.parallel.expert.ExpertParallelSpec`), or
        ``None`` for a model without any. Needed for ``ep > 1``; with ``tp > 1`` the experts run on each tp rank's part
        of the tokens. Its ``load`` (the routers' token counts) is summed over the data-parallel ranks after each
        step's last backward, before the module's ``on_before_optimizer_step``, under every layout.

        Experts contract: ``experts(hidden (N, C), top_k_index (N, K), top_k_weights (N, K)) -> (N, C)`` returns each
        token's weighted sum of its experts' outputs, with the experts' parameters stacked on dim 0 (transformers'
        MoE families and the built-in GPT's ``GroupedExperts``). Under ``ep > 1`` a rank's module holds
        ``num_experts / ep`` of them and gets the rows routed to those (ids counted from its first).
        """

    def check_expert_parallel(self, ep: int) -> None:
        """Raise a one-line ``ValueError`` naming the reason and the fix when ``ep > 1`` cannot split the experts."""

    def reset_parameters(self) -> None:
        """Initialize every parameter after a strategy materialized the model from the meta device.

        Must give each parameter the value it has in one process (e.g. seeded by parameter name), whatever part of
        the model this rank holds.
        """

    def unsharded_parameters(self) -> list[nn.Parameter]:
        """Parameters FSDP2 must leave whole on every data-parallel rank (no gradient: they are frozen), e.g. a QLoRA
        base quantized from each whole weight once loaded (``models/qlora.py``); [] or no hook: FSDP2 shards all."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU; may also be a number attribute."""

    def set_loss_chunks(self, chunks: int) -> None:
        """Compute the output head and the loss in ``chunks`` pieces of the tokens, each recomputed in the backward,
        so the whole ``(B, T, V)`` logits are never held (``0``: the plain loss); the same loss up to fp32 rounding.
        Called by the strategy before the model is laid out (``loss_chunks``), so ``pipeline_spec()`` can follow it.
        """


#: The hook names of :class:`ParallelModule`.
HOOKS: frozenset[str] = frozenset(
    (
        "compute_loss",
        "tensor_parallel_plan",
        "pipeline_spec",
        "check_tensor_parallel",
        "context_parallel_spec",
        "check_context_parallel",
        "expert_parallel_spec",
        "check_expert_parallel",
        "reset_parameters",
        "set_loss_chunks",
        "unsharded_parameters",
    )
)


def module_hook(module: Any, name: str) -> Callable[..., Any] | None:
    """``module``'s implementation of the :class:`ParallelModule` hook ``name``, or ``None`` when it has none."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a ParallelModule hook; the hooks are {sorted(HOOKS)}.")
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def declared_blocks(module: Any) -> list[Any]:
    """The blocks FSDP2 wraps one by one (and activation checkpointing and compile take): those the module declares
    through ``pipeline_spec()``, else the model's repeated blocks (``parallel.data.repeated_blocks``: its longest
    list of same-class modules), so FSDP2 never needs a pipeline spec; [] when there are none."""
    spec_fn = module_hook(module, "pipeline_spec")
    if spec_fn is None:
        return repeated_blocks(module)
    spec = spec_fn()
    return list(module_children(spec.blocks(spec.model(module))).values())


def declared_unsharded(module: Any) -> list[nn.Parameter]:
    """The parameters ``module`` asks FSDP2 to leave whole (its ``unsharded_parameters()``); [] without the hook.

    Raises:
        ValueError: One of them is trained (FSDP2 would not reduce its gradient over the data-parallel ranks).
    """
    hook = module_hook(module, "unsharded_parameters")
    params = list(hook()) if hook is not None else []
    ids = {id(param) for param in params}
    trained = [name for name, param in module.named_parameters() if param.requires_grad and id(param) in ids]
    if trained:
        raise ValueError(
            f"{type(module).__name__}.unsharded_parameters() names {trained[0]}, which is trained; only frozen "
            "parameters may be left out of FSDP2 (their gradients would not be reduced)."
        )
    return params


def declared(module: Any, dims: ParallelDims, options: Parallelism) -> Declared:
    """What ``module`` declares to the layout ``dims``, read once from its hooks and checked against the degrees.

    The module is told its loss chunks first (``set_loss_chunks``): its ``pipeline_spec()`` follows them. A module
    that laid itself out by hand (DTensor parameters made in ``configure_model``) declares its blocks only.

    Raises:
        ValueError: A hook an axis needs is missing, or the module's own check refuses a degree (one line).
    """
    configure_loss_chunks(module, options.loss_chunks)
    name, reset = type(module).__name__, module_hook(module, "reset_parameters")
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return Declared(name=name, blocks=tuple(declared_blocks(module)), reset_parameters=reset)
    return Declared(
        name=name,
        tp_plan=declared_tp_plan(module, dims.tp, options) if dims.tp_enabled else None,
        cp_spec=declared_cp_spec(module, dims.cp),
        ep_spec=declared_ep_spec(module, dims.ep),
        blocks=tuple(declared_blocks(module)),
        unsharded=tuple(declared_unsharded(module)),
        pipeline_spec=declared_pipeline_spec(module) if dims.pp_enabled else None,
        reset_parameters=reset,
    )


def declared_tp_plan(module: Any, tp: int, options: Parallelism) -> TensorParallelPlan:
    """The tensor-parallel plan for ``module``: ``options.tensor.plan`` when given, else the module's
    ``tensor_parallel_plan()``, once its ``check_tensor_parallel`` (when it has one) accepted ``tp``.

    Raises:
        ValueError: The module has no plan and none was given, or its check refuses ``tp`` (one line).
    """
    tensor = options.tensor
    check = module_hook(module, "check_tensor_parallel")
    if check is not None:
        check(tp, sequence_parallel=tensor.sequence_parallel)
    if tensor.plan is not None:
        return dict(tensor.plan)
    method = module_hook(module, "tensor_parallel_plan")
    if method is None:
        raise ValueError(
            f"tp={tp} but {type(module).__name__} has no tensor-parallel plan; pass "
            "plan={'layers.*.q_proj': 'colwise', ...} to the strategy, define tensor_parallel_plan() on the "
            "module, or parallelize it by hand in configure_model."
        )
    return method(sequence_parallel=tensor.sequence_parallel, loss_parallel=tensor.loss_parallel)


def configure_loss_chunks(module: Any, chunks: int) -> None:
    """Tell ``module`` to compute its loss in ``chunks`` pieces (its ``set_loss_chunks``); nothing at ``chunks=0``
    for a module without the hook.

    Raises:
        ValueError: ``chunks > 0`` and the module has no ``set_loss_chunks`` (one line).
    """
    hook = module_hook(module, "set_loss_chunks")
    if hook is not None:
        hook(chunks)
    elif chunks:
        raise ValueError(
            f"loss_chunks={chunks} but {type(module).__name__} has no set_loss_chunks() to compute its loss in pieces "
            "(the built-in GPT and HFCausalLM have one); define it (see lightning_dist.contract.ParallelModule) or "
            "set loss_chunks=0."
        )


def declared_cp_spec(module: Any, cp: int) -> ContextParallelSpec | None:
    """``module``'s ``context_parallel_spec()`` once its ``check_context_parallel`` (when it has one) accepted ``cp``;
    ``None`` at ``cp=1``.

    Raises:
        ValueError: The module has no spec, or its check refuses ``cp`` (one line).
    """
    if cp == 1:
        return None
    spec, check = module_hook(module, "context_parallel_spec"), module_hook(module, "check_context_parallel")
    if spec is None:
        raise ValueError(
            f"cp={cp} but {type(module).__name__} has no context_parallel_spec() naming its attention modules and "
            "position tables; define it (see lightning_dist.contract.ParallelModule) or set cp=1."
        )
    if check is not None:
        check(cp)
    return spec()


def declared_pipeline_spec(module: Any) -> PipelineSpec:
    """``module``'s ``pipeline_spec()``, checked: it has a loss and its model has a forward a stage can run.

    Raises:
        ValueError: The module has no ``pipeline_spec()``, its spec no ``loss_fn``, or its model no forward (one line).
    """
    spec_fn = module_hook(module, "pipeline_spec")
    if spec_fn is None:
        raise ValueError(
            f"{type(module).__name__} has no pipeline_spec(); define it to return a lightning_dist.PipelineSpec "
            "(model, blocks, first/last parts, loss), or set pp=1."
        )
    spec: PipelineSpec = spec_fn()
    if spec.loss_fn is None:
        raise ValueError(f"{type(module).__name__}.pipeline_spec() has no loss_fn; set loss_fn=(outputs, targets).")
    model = spec.model(module)
    if spec.stage_forward is None and type(model).forward is nn.Module.forward:
        raise ValueError(
            f"pipeline_spec().model_attr={spec.model_attr!r} is a {type(model).__name__}, which has no forward for a "
            "stage to run; point model_attr at a module with a forward, or give PipelineSpec(stage_forward=...)."
        )
    return spec


def declared_ep_spec(module: Any, ep: int) -> ExpertParallelSpec | None:
    """``module``'s ``expert_parallel_spec()`` (``None`` for a module without MoE experts), checked against ``ep``.

    Raises:
        ValueError: ``ep > 1`` and the module's ``check_expert_parallel`` refuses it, the module has no experts, its
            spec names no module, or ``ep`` does not divide its experts (one line).
    """
    hook, check = module_hook(module, "expert_parallel_spec"), module_hook(module, "check_expert_parallel")
    if check is not None and ep > 1:
        check(ep)
    spec = hook() if hook is not None else None
    if spec is None:
        if ep > 1:
            raise ValueError(
                f"ep={ep} but {type(module).__name__} has no MoE experts (no expert_parallel_spec(), or it returned "
                "None); use a model with MoE blocks (model.moe.num_experts > 0) or set ep=1."
            )
        return None
    check_expert_parallel(spec.num_experts, ep)
    if not spec.modules(module):
        raise ValueError(
            f"expert_parallel_spec() names experts {list(spec.experts)} but {type(module).__name__} has no module "
            "matching them; fix the patterns (module names relative to the LightningModule)."
        )
    return spec


# --------------------------------------------------------------------------- what lightning-dist reads from a strategy
@runtime_checkable
class MeshStrategyView(Protocol):
    """What the telemetry, data and checkpoint code read from a strategy beyond Lightning's ``Strategy`` API.

    :class:`~lightning_dist.strategies.MeshStrategy` (so every strategy of ours built on it) offers all of it;
    Lightning's own strategies (DDP, FSDP, single device) offer none of it but ``distributed_sampler_kwargs``, and each
    reader falls back to what Lightning offers. Look a strategy up with :func:`strategy_view`, not ``isinstance``:
    before Python 3.12 ``isinstance`` reads every member, and ``parallel_dims`` raises before the Trainer's set-up.
    """

    pending_save: Any
    """The asynchronous checkpoint write in flight (a future), or ``None``; the checkpoint callback takes it (writes
    ``None``)."""

    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated layout (sizes, mesh and groups of every axis); ``RuntimeError`` before the set-up."""

    @property
    def pipeline(self) -> PipelineStages | None:
        """This rank's pipeline stages and schedule (``pp > 1``, after ``setup``), else ``None``."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``{"num_replicas", "rank"}`` of this rank's data-parallel group (tp and pp peers share a coordinate)."""

    def pop_bubble_fraction(self) -> float | None:
        """This rank's pipeline idle fraction since the last call (``None`` without a pipeline or a step)."""


#: The member names of :class:`MeshStrategyView`.
VIEW_MEMBERS: frozenset[str] = frozenset(get_protocol_members(MeshStrategyView))


def strategy_view(strategy: Any) -> MeshStrategyView | None:
    """``strategy`` when it has every :class:`MeshStrategyView` member (our mesh strategies), else ``None`` (Lightning's
    own strategies, or no strategy).

    Each member is looked up without being read (``inspect.getattr_static``: no property runs), so this works before
    the Trainer set the strategy up, when reading ``parallel_dims`` raises.
    """
    if strategy is None:
        return None
    missing = object()
    if all(inspect.getattr_static(strategy, name, missing) is not missing for name in VIEW_MEMBERS):
        return strategy
    return None


def data_parallel_kwargs(strategy: Any) -> dict[str, Any] | None:
    """``{"num_replicas", "rank"}`` of the strategy's data-parallel group: a :class:`MeshStrategyView`'s, else (as
    Lightning's ``Trainer.distributed_sampler_kwargs``) a ``ParallelStrategy``'s (DDP, FSDP, ...); ``None`` for a
    single-device strategy or none."""
    view = strategy_view(strategy)
    if view is not None:
        return view.distributed_sampler_kwargs
    if isinstance(strategy, ParallelStrategy):
        return strategy.distributed_sampler_kwargs
    return None
