"""PipelineParallelStrategy: pipeline stages over ``pp``, composed with tensor parallelism and FSDP2 / replication."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dist.parallel import pipeline
from lightning_dist.parallel.data import apply_fsdp
from lightning_dist.parallel.tensor import TensorParallelPlan, apply_tensor_parallel, expand_plan
from lightning_dist.strategies.tensor_parallel import _DEFAULT_TIMEOUT, TensorParallelStrategy, _compute_dtype


class PipelineParallelStrategy(TensorParallelStrategy):
    """Pipeline parallelism with a ``torch.distributed.pipelining`` schedule, inside a normal Lightning loop.

    Example::

        Trainer(strategy=PipelineParallelStrategy(pp=2, tp=1, dp_shard=-1, schedule="1F1B", microbatches=8))
        Trainer(strategy="pipeline_parallel", devices=2)  # after `import lightning_dist`

    The LightningModule keeps its ``training_step`` calling ``self.compute_loss(batch)`` and describes its model
    with ``pipeline_spec()`` (a :class:`~lightning_dist.parallel.pipeline.PipelineSpec`). In ``setup`` each rank
    builds only its own stages (the model comes from the meta device and only the kept blocks are materialized),
    and ``compute_loss`` is replaced by a call to the schedule: forward and backward of every microbatch run
    inside the training step, the loss (mean over microbatches) is broadcast from the last stage so every rank
    logs the true loss, and Lightning's backward only hands the schedule's gradients back (no second backward).
    Validation runs the schedule's forward-only path. Gradients are clipped by the norm over pp, tp and dp.

    Args:
        pp: Pipeline degree (ranks per pipeline).
        tp: Tensor-parallel degree inside each stage.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree; ``-1`` = the rest.
        schedule: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
            ``ZBVZeroBubble`` or ``DualPipeV``.
        microbatches: Microbatches per step; must divide the per-rank batch. ``None`` = ``pp x stages_per_rank``.
        stages_per_rank: Virtual stages per rank (2+ for the interleaved / looped / V schedules).
        split_points: Block names that start a new stage (``["layers.2"]``); ``None`` = balanced by parameters.
        sequence_parallel: See :class:`TensorParallelStrategy`.
        loss_parallel: See :class:`TensorParallelStrategy`.
        plan: See :class:`TensorParallelStrategy`.
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pp: int = 2,
        tp: int = 1,
        dp_shard: int = -1,
        dp_replicate: int = 1,
        schedule: str = "1F1B",
        microbatches: int | None = None,
        stages_per_rank: int = 1,
        split_points: Sequence[str] | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        plan: TensorParallelPlan | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(
            tp=tp,
            dp_shard=dp_shard,
            dp_replicate=dp_replicate,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            plan=plan,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._degrees["pp"] = pp
        self.schedule_name = pipeline.resolve_schedule(schedule, stages_per_rank)
        self.stages_per_rank = stages_per_rank
        self.microbatches = microbatches if microbatches is not None else pp * stages_per_rank
        pipeline.check_microbatches(self.schedule_name, self.microbatches, pp, stages_per_rank)
        self.split_points = list(split_points) if split_points else None
        self.stage_ids: list[int] = []
        self.stage_blocks: list[list[str]] = []
        self._schedule: Any = None
        self._spec: pipeline.PipelineSpec | None = None
        self._loss_src = 0
        self._pipeline_grads: list[tuple[nn.Parameter, Tensor | None]] = []
        self._bubble: pipeline.BubbleTimer | None = None

    # --------------------------------------------------------------------------------------------------- layout
    def _pp_group(self):
        dims = self.parallel_dims
        return dims.mesh["pp"].get_group() if dims.pp_enabled else None

    @property
    def schedule(self) -> Any:
        """The torch pipeline schedule of this rank; available after ``setup``."""
        if self._schedule is None:
            raise RuntimeError(f"{type(self).__name__}.schedule was read before the Trainer set the model up.")
        return self._schedule

    def pop_bubble_fraction(self) -> float | None:
        """This rank's idle fraction of the training steps since the last call (see ``BubbleTimer``)."""
        return self._bubble.pop_fraction() if self._bubble is not None else None

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # The whole model is only ever built on the meta device: each rank materializes just its own stages.
        with super().tensor_init_context(empty_init=empty_init is not False):
            yield

    # ---------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"precision={self.precision_plugin.precision!r} uses a gradient scaler, which pipeline schedules do "
                "not apply; use precision='bf16-mixed' or '32-true'."
            )
        super().setup(trainer)

    @override
    def _parallelize(self, module: pl.LightningModule) -> None:
        dims = self.parallel_dims
        spec_fn = getattr(module, "pipeline_spec", None)
        if not callable(spec_fn):
            raise ValueError(
                f"{type(module).__name__} has no pipeline_spec(); define it to return a "
                "lightning_dist.parallel.pipeline.PipelineSpec (model, blocks, first/last parts, loss)."
            )
        spec: pipeline.PipelineSpec = spec_fn()
        if spec.loss_fn is None:
            raise ValueError(f"{type(module).__name__}.pipeline_spec() has no loss_fn; set loss_fn=(outputs, targets).")
        model = spec.model(module)
        num_stages = dims.pp * self.stages_per_rank
        keys, costs = pipeline.block_costs(model, spec)
        if self.split_points:
            groups = pipeline.split_at(keys, spec.blocks_attr, self.split_points, num_stages)
        else:
            groups = pipeline.balanced_split(costs, num_stages)
        tp_plan = self._stage_plan(module, spec) if dims.tp_enabled else None
        pp_rank = dims.coordinates(self.global_rank)["pp"]
        self.stage_ids = pipeline.stage_ids(pp_rank, dims.pp, self.stages_per_rank, self.schedule_name)
        self.stage_blocks = [[keys[i] for i in groups[sid]] for sid in self.stage_ids]
        owns_first, owns_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        pipeline.prune_model(
            model, spec, {key for blocks in self.stage_blocks for key in blocks}, owns_first, owns_last
        )
        self._materialize(module, model)

        stages = []
        for sid, blocks in zip(self.stage_ids, self.stage_blocks):
            view = pipeline.stage_view(model, spec, blocks, sid == 0, sid == num_stages - 1)
            self._parallelize_stage(view, spec, tp_plan)
            stages.append(
                PipelineStage(view, sid, num_stages, self.root_device, group=self._pp_group() or _world_group())
            )
        self._schedule = pipeline.build_schedule(self.schedule_name, stages, self.microbatches, spec.loss_fn)
        self._bubble = pipeline.BubbleTimer(stages, self.root_device)
        # The pipeline rank whose stage computes the loss: the last rank, or rank 0 for V schedules.
        self._loss_src = 0 if self.schedule_name in pipeline.V_SCHEDULES else dims.pp - 1
        self._spec = spec
        # The module's own training_step / validation_step call compute_loss: route it through the schedule.
        module.compute_loss = self._pipeline_compute_loss

    def _materialize(self, module: pl.LightningModule, model: nn.Module) -> None:
        """Allocate the kept stages and initialize them as the whole model would have been."""
        if not any(p.is_meta for p in model.parameters()):
            return  # built for real in __init__: the kept blocks keep their values
        model.to_empty(device=self.root_device)
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()  # GPTModule: init_weights(seed) by parameter name, the same on any split
        elif callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            for submodule in model.modules():
                if callable(getattr(submodule, "reset_parameters", None)):
                    submodule.reset_parameters()

    def _stage_plan(self, module: pl.LightningModule, spec: pipeline.PipelineSpec) -> dict[str, Any]:
        """The TP plan relative to the model; every pattern must match the whole (unsplit) model somewhere."""
        plan = self._tensor_parallel_plan(module)
        check = getattr(module, "check_tensor_parallel", None)
        if callable(check):
            check(self.parallel_dims.tp, sequence_parallel=self.sequence_parallel)
        expand_plan(module, plan)  # raises on a pattern that matches nothing in the whole model (a typo)
        prefix = f"{spec.model_attr}."
        return {pattern.removeprefix(prefix): style for pattern, style in plan.items()}

    def _parallelize_stage(self, view: nn.Module, spec: pipeline.PipelineSpec, tp_plan: dict[str, Any] | None) -> None:
        """TP, then FSDP2 with the stage as root; the same order and reasons as ``parallel/compose.py``."""
        dims = self.parallel_dims
        if tp_plan:
            names = [name for name, _ in view.named_modules() if name]
            # Patterns for blocks / parts held by other stages match nothing here (checked on the whole model).
            present = {p: s for p, s in tp_plan.items() if any(_fnmatch(name, p) for name in names)}
            self.applied_plan.update(apply_tensor_parallel(view, dims.mesh["tp"], present))
        if dims.dp_enabled:
            # reshard_after_forward=False: a stage runs forward once per microbatch; resharding would all-gather
            # the same parameters again for each one.
            apply_fsdp(
                list(spec.blocks(view)._modules.values()),
                [view],
                dims.mesh[dims.fsdp_mesh_axes],
                param_dtype=_compute_dtype(self.precision_plugin),
                reshard_after_forward=False,
            )

    # ------------------------------------------------------------------------------------------------- training
    def _pipeline_compute_loss(self, batch: Any) -> Tensor:
        """Run the schedule on ``batch``; return the mean microbatch loss, the same on every pipeline rank."""
        spec = self._spec
        inputs, targets = spec.split_batch(batch) if spec.split_batch is not None else batch
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        size = targets.shape[0]
        if size % self.microbatches:
            raise ValueError(
                f"microbatches={self.microbatches} does not divide the per-rank batch of {size}; pick a divisor of "
                f"{size} or change data.global_batch_size."
            )
        has_first = any(self._schedule_stage_is(sid, first=True) for sid in self.stage_ids)
        has_last = self._owns_last
        kwargs: dict[str, Any] = {"target": targets if has_last else None, "losses": [] if has_last else None}
        losses = kwargs["losses"]
        module = self.lightning_module
        if module.training and torch.is_grad_enabled():
            params = [p for p in module.parameters() if p.requires_grad]
            for param in params:
                param.grad = None  # the schedule accumulates into .grad
            with self._bubble.step():
                self.schedule.step(*(args if has_first else ()), **kwargs)
            # Lightning zeroes gradients between training_step and backward: keep them aside until backward.
            self._pipeline_grads = [(p, p.grad) for p in params]
            for param in params:
                param.grad = None
        else:
            if self.schedule_name in pipeline.V_SCHEDULES:
                raise ValueError(
                    f"schedule={self.schedule_name}: torch 2.13's eval() fails for V schedules; "
                    "disable validation (limit_val_batches=0, num_sanity_val_steps=0) or use Interleaved1F1B."
                )
            self.schedule.eval(*(args if has_first else ()), **kwargs)
        if has_last:
            loss = torch.stack([_local(loss).detach().float() for loss in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.root_device)
        return pipeline.broadcast_loss(loss, self._loss_src, self._pp_group())

    def _schedule_stage_is(self, sid: int, first: bool) -> bool:
        return sid == 0 if first else sid == self.parallel_dims.pp * self.stages_per_rank - 1

    @property
    def _owns_last(self) -> bool:
        return any(self._schedule_stage_is(sid, first=False) for sid in self.stage_ids)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # The schedule already ran backward inside training_step; hand its gradients back instead of running a
        # second backward, keeping Lightning's hooks (on_before_backward / on_after_backward) in place.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for param, grad in self._pipeline_grads:
            param.grad = grad
        self._pipeline_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        self._clip_and_log_grad_norm()
        return closure_loss


def _local(tensor: Tensor) -> Tensor:
    # A loss-parallel loss is a replicated DTensor.
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _fnmatch(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def _world_group():
    import torch.distributed as dist

    return dist.group.WORLD
