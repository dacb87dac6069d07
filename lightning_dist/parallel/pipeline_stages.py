"""PipelineStages: this rank's pipeline stages and schedule, run inside a normal training step.

:func:`lightning_dist.parallel.lay_out.lay_out` builds one when ``pp > 1``. Each rank builds only its own
stages (the model comes from the meta device and only the kept blocks are materialized), parallelizes each stage
with :func:`lightning_dist.parallel.compose.parallelize` like a whole model, and runs the module's step hooks on a
view of it whose ``compute_loss`` calls the schedule (:attr:`PipelineStages.routed`; the user's instance is left as
it is): forward and backward of every microbatch run inside the training step,
the loss (mean over microbatches) is broadcast from the loss stage so every rank logs the true loss, and the
strategy's backward only hands the schedule's gradients back (scaled and added up under gradient accumulation).
Validation, test and predict run the schedule's forward-only path: ``self.compute_loss(batch)`` gives the loss, and
calling the model (``self(x)``, ``self.model(x)``) gives the last stage's outputs, sent to every pipeline rank, so
the module's own ``validation_step`` / ``predict_step`` code (metrics included) runs as in one process.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_dist import _compat
from lightning_dist._compat import module_children
from lightning_dist.parallel import pipeline, tied
from lightning_dist.parallel.bubble import BubbleTimer
from lightning_dist.parallel.compose import Parallelized, parallelize
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.parallel.materialize import materialize as materialize_model
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.parallel.tensor import expand_plan, restrict_plan
from lightning_dist.parallel.tied import shared_parameters
from lightning_dist.parallel_dims import ParallelDims


class PipelineStages:
    """The stages this rank runs, their schedule and bubble timer; built by :meth:`build`."""

    def __init__(
        self,
        module: nn.Module,
        spec: pipeline.PipelineSpec,
        stages: list[PipelineStage],
        schedule: str,
        microbatches: int,
        dims: ParallelDims,
        device: torch.device,
    ) -> None:
        self.module = module
        self.spec = spec
        self.stage_ids = [stage.stage_index for stage in stages]
        self.views = [stage.submod for stage in stages]  # the modules the stages run (pipeline.stage_view)
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.schedule = pipeline.build_schedule(schedule, stages, microbatches, spec.loss_fn)
        self.bubble = BubbleTimer(stages, device)
        self._stages_per_rank = len(stages)
        self._owns_first = any(stage.is_first for stage in stages)
        self._owns_last = any(stage.is_last for stage in stages)
        self._pp, self._pp_group = dims.pp, dims.group("pp")
        # The pipeline rank whose stage computes the loss: the last rank, or rank 0 for V schedules.
        self._loss_src = 0 if schedule in pipeline.V_SCHEDULES else dims.pp - 1
        self._device = device
        self._grads: list[tuple[nn.Parameter, Tensor | None]] = []
        self.layout: RankLayout | None = None  # what this rank holds (set by build)
        self.ties: list[tied.StageTie] = []  # weights shared with other stages' ranks (see parallel/tied.py)
        self.norm_exclude: set[int] = set()  # ids of tied copies the gradient norm must not count again
        self._stepped = False  # the schedule ran in this training step (and backward has not taken its gradients)
        self._output_meta: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # inputs' shapes -> outputs' shape
        self._shapes: tuple | None = None  # the batch shapes the schedule's stages were last set up for

    @classmethod
    def build(
        cls,
        module: nn.Module,
        dims: ParallelDims,
        options: Parallelism,
        declared: Declared,
        global_rank: int,
        device: torch.device,
        *,
        param_dtype: torch.dtype | None = None,
        materialize: bool = True,
    ) -> PipelineStages:
        """Split ``module``'s model, keep this rank's stages, parallelize and materialize them, build the schedule.

        The model stays on the meta device until its stages are sharded, so a rank allocates only its shards of its
        stages (``materialize=False`` leaves it there: a traced rank).

        Stages talk over the ``pp`` axis's group only: with data parallelism beside the pipeline, the world group
        would send activations to a data-parallel peer. Under cp each stage's attention and positions are made
        context-parallel like a whole model's (``declared.cp_spec``, its names taken relative to the split model).
        """
        spec = _checked_spec(module, dims, options, declared)
        pipe = options.pipeline
        model = spec.model(module)
        num_stages = dims.pp * pipe.stages_per_rank
        keys, costs = pipeline.block_costs(model, spec)
        if pipe.split_points:
            groups = pipeline.split_at(keys, spec.blocks_attr, pipe.split_points, num_stages)
        else:
            groups = pipeline.balanced_split(costs, num_stages)
        split = _for_split_model(module, spec, declared)  # before pruning: a plan is checked on the whole model
        stage_ties = _stage_ties(model, spec, keys, groups, dims, options, global_rank)
        pp_rank = dims.coordinates(global_rank)["pp"]
        stage_ids = pipeline.stage_ids(pp_rank, dims.pp, pipe.stages_per_rank, pipe.schedule)
        stage_blocks = [[keys[i] for i in groups[sid]] for sid in stage_ids]
        owns_first, owns_last = 0 in stage_ids, num_stages - 1 in stage_ids
        pipeline.prune_model(model, spec, {key for blocks in stage_blocks for key in blocks}, owns_first, owns_last)
        views, done = [], []
        for sid, blocks in zip(stage_ids, stage_blocks):
            view = pipeline.stage_view(model, spec, blocks, sid == 0, sid == num_stages - 1)
            stage_declared = replace(
                split,
                # Patterns for blocks / parts held by other stages match nothing here (checked on the whole model).
                tp_plan=restrict_plan(view, split.tp_plan) if split.tp_plan else None,
                blocks=tuple(module_children(spec.blocks(view)).values()),
            )
            done.append(parallelize(view, dims, options, stage_declared, param_dtype=param_dtype, stage=True))
            views.append(view)
        if materialize:
            materialize_model(model, device, declared)
            for view in views:
                pipeline.share_buffers(view, model)
        stages = [
            _compat.pipeline_stage(view, i, num_stages, device, dims.group("pp")) for view, i in zip(views, stage_ids)
        ]
        ep_spec = split.ep_spec
        if ep_spec is not None and ep_spec.load is not None:  # torch's shape inference must not count tokens
            for stage in stages:
                _compat.around_pipeline_metadata_inference(stage, ep_spec.load_kept)
        tied.bind(stage_ties, model)  # after parallelizing: TP / FSDP2 replace the parameters
        runner = cls(module, spec, stages, pipe.schedule, pipe.num_microbatches(dims.pp), dims, device)
        runner.ties, runner.norm_exclude = stage_ties, tied.counted_once(stage_ties, pp_rank)
        runner.layout = _stage_layout(dims, global_rank, spec, stage_ids, stage_blocks, done)
        return runner

    @property
    def pp_group(self) -> torch.distributed.ProcessGroup:
        """This rank's pipeline process group."""
        return self._pp_group

    @functools.cached_property
    def routed(self) -> nn.Module:
        """The module as its step hooks see it under the pipeline: ``self.compute_loss(batch)`` runs the schedule.

        A second handle on the same object state (its ``__dict__`` is shared, so logging, metrics and attributes set
        in a step are the module's own) whose class adds only ``compute_loss``; the user's instance and class are
        left as they are. The strategy calls the module's ``training_step`` / ``validation_step`` on it.
        """
        cls = type(self.module)
        run_schedule, model = self.compute_loss, PipelinedModel(self)
        members = {
            "compute_loss": lambda _self, batch: run_schedule(batch),
            self.spec.model_attr: property(lambda _self: model),  # before nn.Module's lookup of its children
            "__qualname__": cls.__qualname__,
        }
        routed_cls = type(cls.__name__, (cls,), {**members, "__module__": cls.__module__})
        view = routed_cls.__new__(routed_cls)
        object.__setattr__(view, "__dict__", self.module.__dict__)
        return view

    def compute_loss(self, batch: Any) -> Tensor:
        """Run the schedule on ``batch``; return the mean microbatch loss, the same on every pipeline rank."""
        inputs, targets, loss_kwargs = self.spec.split(batch)
        args = _compat.stage_inputs(inputs if isinstance(inputs, tuple) else (inputs,))
        pipeline.check_microbatches(
            self.schedule_name, self.microbatches, self._pp, self._stages_per_rank, batch_size=targets.shape[0]
        )
        losses: list[Tensor] | None = [] if self._owns_last else None
        kwargs: dict[str, Any] = {"target": targets if self._owns_last else None, "losses": losses}
        training = self.module.training and torch.is_grad_enabled()
        self._prepare(args, has_backward=training)
        # loss_kwargs go unchanged to every microbatch's loss_fn (targets are cut along dim 0)
        with _compat.schedule_loss_kwargs(self.schedule, loss_kwargs) as loss_kwargs_arg:
            kwargs.update(loss_kwargs_arg)
            if training:
                params = [p for p in self.module.parameters() if p.requires_grad]
                earlier = [p.grad for p in params]  # earlier micro steps' gradients (accumulating): put back below
                for param in params:
                    param.grad = None  # the schedule accumulates into .grad
                with self.bubble.step(), self._stage_contract():
                    self.schedule.step(*(args if self._owns_first else ()), **kwargs)
                # Lightning zeroes gradients between training_step and backward: keep them aside until backward.
                self._grads = [(p, p.grad) for p in params]
                self._stepped = True
                for param, grad in zip(params, earlier):
                    param.grad = grad
            else:
                self._check_eval()
                with self._stage_contract():
                    self.schedule.eval(*(args if self._owns_first else ()), **kwargs)
        if losses is not None:
            loss = torch.stack([_local(loss).detach().float() for loss in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        return pipeline.broadcast_loss(loss, self._loss_src, self._pp_group)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """The whole model's output for a whole batch (forward only, no loss), the same on every pipeline rank.

        What calling the model in a step hook runs under pp (:class:`PipelinedModel`): the last stage's output
        (merged over microbatches, a DTensor made whole) is broadcast from the loss stage. Its shape is sent once per
        input shape; keyword arguments go to the first stage.

        Raises:
            RuntimeError: Called with gradients enabled (``training_step``): the schedule runs forward and backward
                together, in ``self.compute_loss(batch)``.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(self.module).__name__} called its model (self(...) or self.{self.spec.model_attr}(...)) with "
                f"gradients enabled under pp={self._pp}: a pipeline runs forward and backward together, so compute "
                "the training loss with self.compute_loss(batch); calling the model works in validation, test and "
                "predict steps (and under torch.no_grad())."
            )
        self._check_eval()
        tensors = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, Tensor)]
        if not tensors:
            raise ValueError(f"the pipelined {self.spec.model_attr} was called without a tensor input (a batch).")
        pipeline.check_microbatches(
            self.schedule_name, self.microbatches, self._pp, self._stages_per_rank, batch_size=tensors[0].shape[0]
        )
        args = _compat.stage_inputs(args)
        self._prepare((*args, *kwargs.values()), has_backward=False)
        with _compat.pipeline_outputs_only(self.schedule), self._stage_contract():
            outputs = self.schedule.eval(*(args if self._owns_first else ()), **(kwargs if self._owns_first else {}))
        if outputs is not None:
            if not isinstance(outputs, Tensor):
                raise ValueError(
                    f"the last pipeline stage returned a {type(outputs).__name__}; a stage must return one tensor."
                )
            if self.spec.head is not None:  # the stage left the head to the loss: the model's output is its logits
                outputs = self.spec.model(self.module).get_submodule(self.spec.head)(outputs)
            outputs = _local(outputs).contiguous()
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if key not in self._output_meta:  # a host read, once per input shape: the other ranks allocate the outputs
            meta = [(tuple(outputs.shape), outputs.dtype) if outputs is not None else None]
            dist.broadcast_object_list(meta, group=self._pp_group, group_src=self._loss_src)
            self._output_meta[key] = meta[0]
        if outputs is None:
            shape, dtype = self._output_meta[key]
            outputs = torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(outputs, group=self._pp_group, group_src=self._loss_src)
        return outputs

    def _prepare(self, tensors: tuple[Any, ...], has_backward: bool) -> None:
        """Have the stages size their buffers again when this batch's shapes differ from the last one's (a smaller
        last batch, another predict batch size, a cp rank's part), or when a training step follows eval or the other
        way round: the same on every pipeline rank, which all see the batch and the mode."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors if isinstance(t, Tensor))
        if self._shapes is not None and shapes != self._shapes:
            _compat.reshape_pipeline(self.schedule)
        self._shapes = shapes
        _compat.follow_train_eval_switch(self.schedule, has_backward)

    def _check_eval(self) -> None:
        if self.schedule_name in pipeline.V_SCHEDULES:
            raise ValueError(
                f"schedule={self.schedule_name}: torch's eval() fails for V schedules (2.11, 2.13); disable validation "
                "(limit_val_batches=0, num_sanity_val_steps=0), or use Interleaved1F1B for validate / test / predict."
            )

    @contextmanager
    def _stage_contract(self) -> Iterator[None]:
        """Name the stage contract when the model's own forward fails on a stage that holds only part of it.

        Decided by where the error was raised (a frame of the model's ``forward`` or of ``stage_forward``, i.e. the
        user's code run on a partial model), not by its text; errors of torch's schedule pass unchanged.
        """
        try:
            yield
        except (TypeError, AttributeError) as err:
            model_cls = type(self.spec.model(self.module))
            forwards = {model_cls.forward.__code__}
            if self.spec.stage_forward is not None and hasattr(self.spec.stage_forward, "__code__"):
                forwards.add(self.spec.stage_forward.__code__)
            if not any(frame.f_code in forwards for frame, _ in traceback.walk_tb(err.__traceback__)):
                raise
            model = model_cls.__name__
            raise ValueError(
                f"{model}.forward failed on pipeline stage(s) {self.stage_ids}, which hold only part of the model "
                f"({type(err).__name__}: {err}); a stage's forward must take the previous stage's output, skip the "
                "parts pipeline_spec() lists as first / last when they are None, and return one tensor. Make forward "
                "do that, give PipelineSpec(stage_forward=...), or for a HuggingFace causal LM use "
                "lightning_dist.models.hf.HFCausalLM."
            ) from err

    def restore_grads(self, scale: float = 1.0) -> None:
        """Hand back the gradients the schedule computed in the last training step (called from backward).

        Args:
            scale: Multiplies them before they are added to the gradients already there: ``1 / k`` under
                ``accumulate_grad_batches=k`` (Lightning divides the loss by ``k`` before backward), so k schedule
                steps add up to the gradient of their mean loss, as in one process.

        Raises:
            RuntimeError: The training step did not run the schedule (its ``training_step`` called the model itself,
                not ``self.compute_loss``): no parameter would be updated.
        """
        if not self._stepped:
            raise RuntimeError(
                f"{type(self.module).__name__}.training_step did not call self.compute_loss(batch): under "
                f"pp={self._pp} the pipeline schedule runs forward and backward inside compute_loss, so nothing would "
                "be trained; compute the loss with self.compute_loss(batch) in training_step and return it."
            )
        self._stepped = False
        earlier = []
        for param, grad in self._grads:
            earlier.append(param.grad)
            param.grad = grad
        tied.sum_grads(self.ties)  # a weight shared across stages gets the sum of its uses, as in one process
        for (param, _), grad in zip(self._grads, earlier):
            if param.grad is not None and scale != 1.0:
                param.grad.mul_(scale)
            if grad is not None:  # an earlier micro step's: add this one's (the tie summed once per micro step)
                param.grad = grad.add_(param.grad) if param.grad is not None else grad
        self._grads = []


def _checked_spec(module: nn.Module, dims: ParallelDims, options: Parallelism, declared: Declared) -> PipelineSpec:
    """The module's pipeline spec, with what the pipeline cannot do refused in one line."""
    spec = declared.pipeline_spec
    if spec is None:
        raise ValueError(
            f"{declared.name} has no pipeline_spec(); define it to return a lightning_dist.PipelineSpec (model, "
            "blocks, first/last parts, loss), or set pp=1."
        )
    if options.loss_chunks and spec.head is None:
        raise ValueError(
            f"parallelism.loss_chunks={options.loss_chunks} with pp={dims.pp}: {declared.name}'s last stage applies "
            "the head itself (its pipeline_spec() names no head for the loss to apply in pieces; the built-in GPT's "
            "does); set parallelism.loss_chunks=0."
        )
    if declared.ep_spec is not None and dims.ep_enabled and not _compat.infers_stage_shapes_on_real_tensors():
        raise ValueError(
            f"pp={dims.pp} with ep={dims.ep} needs torch >= 2.13: torch {torch.__version__} infers a stage's shapes on "
            "meta tensors, which the experts' all-to-all cannot exchange; upgrade torch, or set pp=1 or ep=1."
        )
    return spec


def _for_split_model(module: nn.Module, spec: PipelineSpec, declared: Declared) -> Declared:
    """``declared`` with its names relative to the split model, as the stages hold them (plans and specs name
    modules relative to the LightningModule)."""
    prefix = f"{spec.model_attr}."
    plan = declared.tp_plan
    if plan is not None:
        expand_plan(module, plan)  # a pattern that matches nothing in the whole (unsplit) model is a typo
        plan = {pattern.removeprefix(prefix): style for pattern, style in plan.items()}
    cp_spec = pipeline.stage_cp_spec(module, declared.cp_spec, spec.model_attr) if declared.cp_spec else None
    ep_spec = declared.ep_spec.relative_to(prefix) if declared.ep_spec is not None else None
    return replace(declared, tp_plan=plan, cp_spec=cp_spec, ep_spec=ep_spec, unsharded=())


def _stage_ties(
    model: nn.Module,
    spec: PipelineSpec,
    keys: list[str],
    groups: list[list[int]],
    dims: ParallelDims,
    options: Parallelism,
    global_rank: int,
) -> list[tied.StageTie]:
    """The weights tied across stages (each rank's copy kept one in effect: parallel/tied.py), their groups made."""
    pipe = options.pipeline
    stage_of = tied.stage_of_name(spec, keys, groups)
    stage_ties = tied.find_stage_ties(shared_parameters(model), stage_of, dims, pipe.stages_per_rank, pipe.schedule)
    if stage_ties and dims.tp_enabled:
        names = " and ".join(stage_ties[0].names)
        raise ValueError(
            f"{names} are one (tied) parameter on different pipeline stages, which is not supported with tp={dims.tp} "
            "yet (their tensor-parallel shards are not matched across stages); untie them, or use pp or tp alone."
        )
    tied.create_groups(stage_ties, dims, global_rank)
    return stage_ties


def _stage_layout(
    dims: ParallelDims,
    global_rank: int,
    spec: PipelineSpec,
    stage_ids: list[int],
    stage_blocks: list[list[str]],
    done: list[Parallelized],
) -> RankLayout:
    """What this rank holds: its stages and their blocks, with names as the LightningModule's (like a whole model's)."""
    prefix = f"{spec.model_attr}."
    fsdp_units = [
        f"stage {sid}: {prefix}{unit}" if unit != "(root)" else f"stage {sid}: {spec.model_attr}"
        for sid, stage in zip(stage_ids, done)
        for unit in stage.fsdp_units
    ]
    return RankLayout.of(
        dims,
        global_rank,
        stages=tuple(stage_ids),
        blocks=tuple(
            tuple(f"{spec.blocks_attr}.{key}" if spec.blocks_attr else key for key in blocks) for blocks in stage_blocks
        ),
        tp_styles={prefix + name: style for stage in done for name, style in stage.tp_styles.items()},
        fsdp_units=tuple(fsdp_units),
        experts=next((stage.experts for stage in done if stage.experts), ""),
    )


class PipelinedModel:
    """``self.<model_attr>`` as a module's step hooks see it under pp: calling it runs :meth:`PipelineStages.forward`.

    Any other attribute is the real model's (this rank's stages), so ``self.model.config`` and the like still read.
    """

    def __init__(self, stages: PipelineStages) -> None:
        self._stages = stages

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._stages.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "_stages":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self._stages.spec.model(self._stages.module), name)


def _local(tensor: Tensor) -> Tensor:
    # A loss-parallel loss is a replicated DTensor.
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
