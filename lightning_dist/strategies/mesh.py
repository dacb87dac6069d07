"""MeshStrategy: the one Lightning strategy for every layout of a ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh.

Which path runs follows from the degrees alone: ``pp > 1`` splits the model into pipeline stages
(:class:`~lightning_dist.strategies.stages.PipelineStages`), otherwise the whole model is parallelized. Both go through
:func:`lightning_dist.parallel.compose.parallelize` (TP, then FSDP2 / replication). ``TensorParallelStrategy`` and
``PipelineParallelStrategy`` are named presets of this class.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_dist import _compat
from lightning_dist.checkpoint import full
from lightning_dist.checkpoint import store as checkpoint_io
from lightning_dist.contract import (
    configure_loss_chunks,
    declared_blocks,
    declared_cp_spec,
    declared_ep_spec,
    declared_tp_plan,
    declared_unsharded,
    module_hook,
)
from lightning_dist.parallel.clip import clip_grad_norm_
from lightning_dist.parallel.compose import parallelize
from lightning_dist.parallel.data import param_dtype_of
from lightning_dist.parallel.float8 import high_precision_state
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.parallel.tensor import reduce_partial_grads
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies.context import ContextParallelMixin
from lightning_dist.strategies.guard import GuardedStrategyMixin
from lightning_dist.strategies.loaders import LoaderOrderMixin
from lightning_dist.strategies.materialize import materialize as materialize_model
from lightning_dist.strategies.metrics import DataParallelMetricsMixin, sum_expert_load
from lightning_dist.strategies.outer_sync import DiLoCoMixin
from lightning_dist.strategies.pipeline_steps import PipelineStepsMixin
from lightning_dist.strategies.stages import PipelineStages


class MeshStrategy(
    DiLoCoMixin,
    DataParallelMetricsMixin,
    GuardedStrategyMixin,
    LoaderOrderMixin,
    _compat.BeforeLaunchHook,
    ContextParallelMixin,  # the step hooks above call it with the whole batch
    PipelineStepsMixin,  # under pp, the module's steps on the pipeline's view, with this cp rank's batch
    ModelParallelStrategy,
):
    """Data, tensor, context and pipeline parallelism on one device mesh, with Lightning's loops, loggers, checkpoints.

    Registered in Lightning's ``StrategyRegistry`` as ``"mesh"`` (and ``"fsdp2"``): ``Trainer(strategy="mesh")`` is
    FSDP2 over all devices. Lightning's own ``"fsdp"`` is its ``FSDPStrategy``, the older FSDP1 wrapper; every
    sharded layout here (``dp_shard > 1``, the app's ``parallelism=fsdp``) is FSDP2 (``torch`` ``fully_shard``).

    Example::

        Trainer(strategy=MeshStrategy(tp=2, dp_shard=-1), devices=4)               # TP inside, FSDP2 across
        Trainer(strategy=MeshStrategy(pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2), devices=4)
        Trainer(strategy=MeshStrategy(parallel_dims=ParallelDims(world_size=4, tp=2)), devices=4)

    The model is parallelized after ``configure_model``: with ``plan`` when given, else with the module's
    ``tensor_parallel_plan()``; under ``pp > 1`` split by its ``pipeline_spec()`` (see
    :class:`~lightning_dist.contract.ParallelModule`). A module whose ``configure_model`` already made DTensor
    parameters (hand-written ``parallelize_module`` / ``fully_shard`` on ``self.device_mesh``) is left as it is.
    Gradients are clipped by the norm over every axis, logged as ``train/grad_norm`` on logging steps. Checkpoints are
    sharded (``torch.distributed.checkpoint``) and resume exactly under any layout, as does one process's single file.

    Args:
        dp_replicate: Replica degree (HSDP when ``dp_shard > 1`` too); ``-1`` = the rest of the world size.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest.
        tp: Tensor-parallel degree; ``-1`` = the rest.
        pp: Pipeline degree.
        cp: Context-parallel degree (the module's ``context_parallel_spec()``; see ``strategies/context.py``).
        ep: Expert-parallel degree (the module's ``expert_parallel_spec()``; see ``parallel/expert.py``): MoE experts
            split over ``ep`` of the ``dp_shard`` ranks.
        parallel_dims: A layout built already (the app builds it once from the config); replaces the degrees.
        options: How the axes work (TP plan, schedule, microbatches, activation checkpointing, compile, offload,
            the non-finite guard, async saves, process groups): a
            :class:`~lightning_dist.parallel.options.ParallelOptions`.
        option_fields: Single :class:`~lightning_dist.parallel.options.ParallelOptions` fields, set over
            ``options`` (``MeshStrategy(tp=2, schedule="GPipe")``; DiLoCo: ``dp_replicate=2, sync="diloco"``).
    """

    strategy_name = "mesh"
    #: Sums the MoE routers' token counts over the data-parallel ranks each step (``metrics.sum_expert_load``).
    sums_expert_load = True

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        *,
        parallel_dims: ParallelDims | None = None,
        options: ParallelOptions | None = None,
        **option_fields: Any,
    ) -> None:
        self.options = ParallelOptions.build(options, **option_fields).for_mesh()
        super().__init__(process_group_backend=self.options.process_group_backend, timeout=self.options.timeout)
        self._degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
        self._parallel_dims = parallel_dims
        pp = parallel_dims.pp if parallel_dims is not None else pp
        if pp > 1:  # known before the world size: a pipeline option that cannot work fails at construction
            self.options.check_microbatches(pp)
        self.pending_save: Any = None
        self._pipeline: PipelineStages | None = None
        self._layout: RankLayout | None = None
        self._layouts: list[RankLayout] = []
        self._parallelized = False
        self._clip_val: float | None = None
        self._checkpoint_group: Any = None
        self._names: full.ModelNames | None = None  # the unsplit module's names and shapes (single-file loads)
        self._single_file = False  # the checkpoint being restored is one file (its optimizer restored by Lightning)

    # --------------------------------------------------------------------------------------------------- layout
    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated layout; available once the number of processes is known."""
        if self._parallel_dims is None:
            raise RuntimeError(f"{type(self).__name__}.parallel_dims was read before the Trainer set up processes.")
        return self._parallel_dims

    def describe(self, all_ranks: bool = False) -> RankLayout | list[RankLayout]:
        """What this rank holds once the model is laid out (``setup`` done): its mesh coordinates, pipeline stages
        and their blocks, the tensor-parallel style of each module and the FSDP2 units; ``all_ranks=True``: every
        rank's, gathered once at set-up (no collective here).

        Raises:
            RuntimeError: Read before the Trainer set the model up.
        """
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__}.describe() was called before the Trainer set the model up.")
        return list(self._layouts) if all_ranks else self._layout

    @property
    def pipeline(self) -> PipelineStages | None:
        """This rank's pipeline stages and schedule (``pp > 1``, after ``setup``), else ``None``."""
        return self._pipeline

    @override
    def before_launch(self) -> None:
        # The number of processes is known here, before Lightning launches any: the layout fails once, here.
        world_size = self.num_nodes * self.num_processes
        if self._parallel_dims is None:
            self._parallel_dims = ParallelDims(world_size=world_size, **self._degrees)
        elif self._parallel_dims.world_size != world_size:
            raise ValueError(
                f"parallel_dims is laid out for world_size={self._parallel_dims.world_size} but the Trainer runs "
                f"{world_size} processes (devices={self.num_processes} x num_nodes={self.num_nodes}); make them equal."
            )
        self.options.check(self._parallel_dims)

    @override
    def setup_environment(self) -> None:
        _compat.setup_distributed(self)
        if self._parallel_dims is None:  # launched externally (torchrun): no launcher was configured here
            self.before_launch()
        mesh = self.parallel_dims.build_mesh(self.root_device.type)
        _compat.set_device_mesh(self, self.lightning_module, mesh)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that share a data-parallel coordinate (tp / pp peers) must read the same batches.
        dims = self.parallel_dims
        return {"num_replicas": dims.dp_size, "rank": dims.dp_rank(self.global_rank)}

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # A model whose module can initialize any part of it (reset_parameters) is built on the meta device: each rank
        # materializes just its own stages / shards (see materialize.py). Without that hook it is built for real,
        # drawing the same random numbers as one process, and each rank keeps its part's values.
        if empty_init is None:
            empty_init = module_hook(self.lightning_module, "reset_parameters") is not None
        with super().tensor_init_context(empty_init=empty_init):
            yield

    # ---------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        name = type(self).__name__
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: {name} clips by the "
                "global norm only; use gradient_clip_algorithm='norm'."
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            # A pipeline schedule runs backward itself, and the norm over all axes is clipped before the scaler
            # unscales: fp16 loss scaling would silently clip (and log) scaled gradients.
            raise ValueError(
                f"precision={self.precision_plugin.precision!r} uses a gradient scaler, which {name} does not apply; "
                "use precision='bf16-mixed' or '32-true'."
            )
        self.take_over_loaders(trainer)
        # Lightning's clipping sees one shard / one stage; we clip by the norm over all axes (see backward).
        if trainer.gradient_clip_val is not None:
            self._clip_val, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None
        # DTensor does not support inference tensors: validation runs under no_grad instead of inference_mode.
        _compat.disable_inference_mode(trainer)
        if not self._parallelized:
            self._names = full.ModelNames.of(self.lightning_module)
            self.parallelize_module(self.lightning_module)
            self._layout = self.with_sync(self._layout)
            self._parallelized = True
            # Once, at start-up: every rank's layout for describe(all_ranks=True) (a small object per rank).
            self._layouts = [None] * self.world_size
            torch.distributed.all_gather_object(self._layouts, self._layout)
        self.sync_metrics_over_data_parallel(self.lightning_module)
        _compat.materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # and DiLoCo, under sync=diloco (outer_sync.py)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.options.cpu_offload:  # offloaded state stays on the host
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def parallelize_module(self, module: pl.LightningModule, materialize: bool = True) -> None:
        """Lay ``module`` out over the mesh; ``materialize=False`` leaves it on the meta device (a traced rank)."""
        dims, options = self.parallel_dims, self.options
        configure_loss_chunks(module, options.loss_chunks)  # before pipeline_spec(): the last stage's output follows
        if any(isinstance(p, DTensor) for p in module.parameters()):
            self._layout = RankLayout.of(dims, self.global_rank, parallelized_by="configure_model")
            return  # parallelized by hand in configure_model
        tp_plan = declared_tp_plan(module, dims.tp, options) if dims.tp_enabled else None
        dtype = param_dtype_of(str(getattr(self.precision_plugin, "precision", "")))  # FSDP2's compute dtype
        ep_spec, cp_spec = declared_ep_spec(module, dims.ep), declared_cp_spec(module, dims.cp)
        if dims.pp_enabled:
            self._pipeline = PipelineStages.build(
                module,
                dims,
                options,
                self.global_rank,
                self.root_device,
                tp_plan=tp_plan,
                param_dtype=dtype,
                cp_spec=cp_spec,
                ep_spec=ep_spec,
                materialize=materialize,
            )
            self._layout = self._pipeline.layout
            return
        done = parallelize(
            module,
            dims,
            options,
            tp_plan=tp_plan,
            cp_spec=cp_spec,
            ep_spec=ep_spec,
            param_dtype=dtype,
            fsdp_units=declared_blocks(module),
            fsdp_ignored=declared_unsharded(module),
        )
        self._layout = RankLayout.of(dims, self.global_rank, **vars(done))  # its styles, FSDP2 units and cp attention
        if materialize:
            materialize_model(module, module, self.root_device)  # sharded first: each rank allocates its shards only

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return checkpoint_io.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        path = Path(self.broadcast(filepath))
        # Lightning's sharded layout; under DiLoCo each replica's own keys and the outer state (see outer_sync.py)
        state = self.with_replica_state(checkpoint_io.sharded_state(checkpoint), checkpoint)
        if self.options.float8 == "tensorwise":  # plain high-precision tensors, not torchao's float8 weight wrappers
            state = high_precision_state(state)
        if not self.options.async_save:
            checkpoint_io.save(state, checkpoint, path, self.global_rank)
            return
        if self._checkpoint_group is None:  # the background writes' collectives: a gloo group of their own
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        self.pending_save = checkpoint_io.save(state, checkpoint, path, self.global_rank, self._checkpoint_group)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint of any layout into this one, once its names and shapes are checked against the module's.

        A sharded folder is loaded here (:func:`lightning_dist.checkpoint.store.load_sharded`); a single file (one
        process's) is mapped and returned whole, for :meth:`load_model_state_dict` / :meth:`load_optimizer_state_dict`
        (:mod:`lightning_dist.checkpoint.full`). Lightning's own loader needs DTensor parameters and one model on
        every rank; pipeline ranks hold different parameters, plain tensors without TP or FSDP.

        Raises:
            ValueError: A tensor is missing, unexpected or of another shape (one line naming it).
        """
        path = Path(self.broadcast(checkpoint_path))
        strict = self.lightning_module.strict_loading
        self._single_file = not path.is_dir()
        if self._single_file:
            checkpoint = full.read(path, weights_only)
            full.check_module_fits(path, full.shapes_of(checkpoint, path), self._names, strict)
            return checkpoint
        full.check_module_fits(path, full.checkpoint_shapes(path), self._names, strict)
        return self.load_sharded_checkpoint(path, strict, weights_only)  # under DiLoCo, each replica's (outer_sync.py)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self._single_file  # a sharded folder's optimizer state was loaded in load_checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._single_file:
            full.load_model(self.model, checkpoint[full.MODEL_KEY], strict=strict)
            self.reset_diloco()  # one file holds no replica's DiLoCo state

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        strict = self.lightning_module.strict_loading
        full.load_optimizers(self.model, self.optimizers, checkpoint["optimizer_states"], self._names, strict=strict)

    # ------------------------------------------------------------------------------------------------- training
    @contextmanager
    def loss_context(self) -> Generator[None, None, None]:
        """Loss parallelism must wrap the loss's forward and its backward."""
        use = self.options.loss_parallel and self.parallel_dims.tp_enabled
        with loss_parallel() if use else nullcontext():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():  # then the cp split, then the pipeline (the bases' order)
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().test_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline is not None:
            # The schedule already ran backward inside training_step; hand its gradients back instead of running a
            # second backward, keeping Lightning's hooks (on_before_backward / on_after_backward) in place.
            module = self.lightning_module
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            # Lightning divides the loss by accumulate_grad_batches before backward; the schedule's gradients too.
            self._pipeline.restore_grads(scale=1.0 / module.trainer.accumulate_grad_batches)
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
        else:
            with self.loss_context():
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        return closure_loss

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduction on the accumulating micro-steps: FSDP2 keeps unsharded gradients until the last."""
        fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in fsdp_modules:
                module.set_requires_gradient_sync(True, recurse=False)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()  # forward + backward of the step's last (or only) micro batch
        if self.parallel_dims.dp_cp_size > 1:  # the MoE routers' load over the global batch, for the module's balancing
            sum_expert_load(self.lightning_module, self.dp_group)
        norm = self._clip_gradients()
        apply = self.with_outer_step(partial(super().optimizer_step, optimizer, lambda: loss, model, **kwargs))
        return self.nonfinite_guard.optimizer_step(optimizer, norm, loss, self.lightning_module, apply)

    def _clip_gradients(self) -> Tensor:
        """Clip the step's whole gradient (every micro batch in) by its norm over all axes; log ``train/grad_norm``."""
        # The stages keep the pp group: ParallelDims.group builds a sub-mesh per call (~0.2 ms of host time).
        pp_group = self._pipeline.pp_group if self._pipeline is not None else None
        skip = self._pipeline.norm_exclude if self._pipeline is not None else frozenset()
        reduce_partial_grads(self.model.parameters())  # once, not again in every op that reads them
        norm = clip_grad_norm_(self.model.parameters(), self._clip_val, pp_group, norm_exclude=skip)
        if _compat.logs_this_step(self.lightning_module.trainer):  # Lightning's log() costs ~0.5 ms of host time
            self.lightning_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        return norm

    def pop_bubble_fraction(self) -> float | None:
        """This rank's pipeline idle fraction since the last call (``None`` without a pipeline or a step)."""
        return self._pipeline.bubble.pop_fraction() if self._pipeline is not None else None
