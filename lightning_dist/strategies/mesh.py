"""MeshStrategy: the one Lightning strategy for every layout of a ``(pp, dp_replicate, dp_shard, cp, tp, ep)`` mesh.

Which path runs follows from the degrees alone: the model is laid out by :func:`lightning_dist.parallel.lay_out.
lay_out` (``pp > 1``: this rank's pipeline stages; else the whole model, TP then FSDP2 / replication). Each step
hook runs one stage of the step, written once in :mod:`lightning_dist.parallel.step`. What is not the step is a
member, not a base: the non-finite guard, DiLoCo (:class:`~lightning_dist.strategies.outer_sync.OuterSync`), the
metrics' reduction (:class:`~lightning_dist.strategies.metrics.DataParallelMetrics`), the loaders' order
(:class:`~lightning_dist.strategies.loaders.LoaderDealer`) and the cp changes across loops
(:class:`~lightning_dist.strategies.context.ContextParallelChanges`). ``TensorParallelStrategy`` and
``PipelineParallelStrategy`` are named presets of this class.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_dist import _compat, contract
from lightning_dist.checkpoint import full
from lightning_dist.checkpoint import store as checkpoint_io
from lightning_dist.parallel import step
from lightning_dist.parallel.data import param_dtype_of
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.float8 import high_precision_state
from lightning_dist.parallel.guard import NonFiniteGuard
from lightning_dist.parallel.lay_out import LaidOut, lay_out
from lightning_dist.parallel.layout import RankLayout
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel.pipeline_stages import PipelineStages
from lightning_dist.parallel.replicas import FROM_PEER, FaultTolerantReplicas
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies.context import ContextParallelChanges
from lightning_dist.strategies.loaders import LoaderDealer
from lightning_dist.strategies.metrics import DataParallelMetrics
from lightning_dist.strategies.outer_sync import OuterSync
from lightning_dist.strategies.replica_state import ReplicaState

#: A collective that waits this long ends the job (torch's process-group timeout).
DEFAULT_TIMEOUT = timedelta(minutes=10)


class MeshStrategy(_compat.BeforeLaunchHook, ModelParallelStrategy):
    """Data, tensor, context, expert and pipeline parallelism on one device mesh, with Lightning's loops, loggers and
    checkpoints.

    Registered in Lightning's ``StrategyRegistry`` as ``"mesh"`` (and ``"fsdp2"``): ``Trainer(strategy="mesh")`` is
    FSDP2 over all devices. Lightning's own ``"fsdp"`` is its ``FSDPStrategy``, the older FSDP1 wrapper; every
    sharded layout here (``dp_shard > 1``, the app's ``parallelism=fsdp``) is FSDP2 (``torch`` ``fully_shard``).

    Example::

        Trainer(strategy=MeshStrategy(tp=2, dp_shard=-1), devices=4)               # TP inside, FSDP2 across
        Trainer(strategy=MeshStrategy(pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2), devices=4)
        Trainer(strategy=MeshStrategy(parallel_dims=ParallelDims(world_size=4, tp=2)), devices=4)

    The model is laid out after ``configure_model``: with ``plan`` when given, else with the module's
    ``tensor_parallel_plan()``; under ``pp > 1`` split by its ``pipeline_spec()`` (see
    :class:`~lightning_dist.contract.ParallelModule`). A module whose ``configure_model`` already made DTensor
    parameters (hand-written ``parallelize_module`` / ``fully_shard`` on ``self.device_mesh``) is left as it is.
    Gradients are clipped by the norm over every axis, logged as ``train/grad_norm`` on logging steps. Checkpoints are
    sharded (``torch.distributed.checkpoint``) and resume exactly under any layout, as does one process's single file.

    Args:
        dp_replicate: Replica degree (HSDP when ``dp_shard > 1`` too); ``-1`` = the rest of the world size.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest (the default).
        tp: Tensor-parallel degree; ``-1`` = the rest.
        pp: Pipeline degree.
        cp: Context-parallel degree (the module's ``context_parallel_spec()``; see ``parallel/context.py``).
        ep: Expert-parallel degree (the module's ``expert_parallel_spec()``; see ``parallel/expert.py``): MoE experts
            split over ``ep`` of the ``dp_shard`` ranks.
        parallel_dims: A layout built already (the app builds it once from the config); replaces the degrees.
        parallelism: How the axes work (:class:`~lightning_dist.parallel.options.Parallelism`: its sections
            ``tensor``, ``pipeline``, ``context``, ``fsdp``, ``diloco``, ...); degrees given here win over its own.
        on_nonfinite: A step whose gradient norm is NaN / Inf: ``stop`` the run, or ``skip`` the update.
        async_save: Checkpoints are copied to host memory and written in the background (DCP ``async_save``).
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout: a rank that stops answering ends the job after this long.
        options: Single option fields over ``parallelism``: a section's field by its own name
            (``MeshStrategy(pp=2, schedule="GPipe")`` sets ``parallelism.pipeline.schedule``), or a whole section
            (``diloco={"every": 10}``).
    """

    strategy_name = "mesh"
    #: Sums the MoE routers' token counts over the data-parallel ranks each step (``step.finish_gradients``).
    sums_expert_load = True

    def __init__(
        self,
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
        tp: int | None = None,
        pp: int | None = None,
        cp: int | None = None,
        ep: int | None = None,
        *,
        parallel_dims: ParallelDims | None = None,
        parallelism: Parallelism | None = None,
        on_nonfinite: str = "stop",
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
        given = {axis: degree for axis, degree in degrees.items() if degree is not None}
        self.parallelism = (parallelism or Parallelism()).with_fields(**given, **options)
        if self.parallelism.ddp.comm_hook is not None:
            raise ValueError(
                f"parallelism.ddp.comm_hook={self.parallelism.ddp.comm_hook!r} is Lightning DDP's; FSDP2 (the mesh "
                "strategies) halves its gradient bytes with parallelism.fsdp.reduce_dtype='bf16' instead."
            )
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._parallel_dims = parallel_dims
        pipeline_degree = parallel_dims.pp if parallel_dims is not None else self.parallelism.pp
        if pipeline_degree > 1:  # known before the world size: a pipeline option that cannot work fails at construction
            self.parallelism.pipeline.check_microbatches(pipeline_degree)
        self.async_save = async_save
        self.pending_save: Any = None
        self._nonfinite_guard = NonFiniteGuard(on_nonfinite, warn=rank_zero_warn)
        self._outer = OuterSync(self.parallelism)
        self._loaders = LoaderDealer()
        self._cp_changes = ContextParallelChanges()
        self._metrics: DataParallelMetrics | None = None
        self._replicas: FaultTolerantReplicas | None = None  # parallelism.replicas.recovery=torchft, once set up
        self._job_dims: ParallelDims | None = None  # the whole job's layout, where this process runs one replica group
        self._declared = Declared()
        self._laid_out: LaidOut | None = None
        self._layouts: list[RankLayout] = []
        self._clip_val: float | None = None
        self._checkpoint_group: Any = None
        self._names: full.ModelNames | None = None  # the unsplit module's names and shapes (single-file loads)
        self._single_file = False  # the checkpoint being restored is one file (its optimizer restored by Lightning)

    # --------------------------------------------------------------------------------------------------- layout
    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated layout of this process's mesh; available once the number of processes is known. Under
        ``parallelism.replicas.recovery=torchft`` it is one replica group's (``ParallelDims.replica_group``): the
        groups meet through torchft, not the mesh."""
        if self._parallel_dims is None:
            raise RuntimeError(f"{type(self).__name__}.parallel_dims was read before the Trainer set up processes.")
        return self._parallel_dims

    @property
    def replicas(self) -> FaultTolerantReplicas | None:
        """The fault-tolerant replica groups this rank's group belongs to (torchft), once set up; else ``None``."""
        return self._replicas

    def describe(self, all_ranks: bool = False) -> RankLayout | list[RankLayout]:
        """What this rank holds once the model is laid out (``setup`` done): its mesh coordinates, pipeline stages
        and their blocks, the tensor-parallel style of each module and the FSDP2 units; ``all_ranks=True``: every
        rank's, gathered once at set-up (no collective here).

        Raises:
            RuntimeError: Read before the Trainer set the model up.
        """
        if self._laid_out is None:
            raise RuntimeError(f"{type(self).__name__}.describe() was called before the Trainer set the model up.")
        return list(self._layouts) if all_ranks else self._laid_out.layout

    @property
    def pipeline(self) -> PipelineStages | None:
        """This rank's pipeline stages and schedule (``pp > 1``, after ``setup``), else ``None``."""
        return self._laid_out.pipeline if self._laid_out is not None else None

    @property
    def diloco(self) -> Any:
        """This rank's :class:`~lightning_dist.parallel.diloco.DiLoCo` (``sync=diloco``, once fitting set up)."""
        return self._outer.diloco

    @property
    def nonfinite_guard(self) -> NonFiniteGuard:
        """This strategy's non-finite guard (``on_nonfinite``)."""
        return self._nonfinite_guard

    @property
    def metrics(self) -> DataParallelMetrics:
        """How logged values and metrics reduce: over the data-parallel ranks (available once the mesh is built)."""
        if self._metrics is None:
            self._metrics = DataParallelMetrics(self.parallel_dims)
        return self._metrics

    def before_launch(self) -> None:
        """Build and check the layout once the number of processes is known (``_compat.BeforeLaunchHook``)."""
        # The number of processes is known here, before Lightning launches any: the layout fails once, here.
        if self._job_dims is not None:
            return  # checked already (launched externally: setup_environment calls this)
        fault_tolerant = self.parallelism.replicas.fault_tolerant
        groups = (self._parallel_dims or self.parallelism).dp_replicate if fault_tolerant else 1
        world_size = self.num_nodes * self.num_processes * groups  # torchft: this Trainer runs one replica group
        if self._parallel_dims is None:
            self._parallel_dims = ParallelDims(world_size=world_size, **self.parallelism.degrees)
        elif self._parallel_dims.world_size != world_size:
            one = " per replica group" if fault_tolerant else ""
            raise ValueError(
                f"parallel_dims is laid out for world_size={self._parallel_dims.world_size} but the Trainer runs "
                f"{world_size // groups} processes{one} (devices={self.num_processes} x num_nodes={self.num_nodes}); "
                "make them equal."
            )
        self.parallelism.check(self._parallel_dims)
        self._job_dims = self._parallel_dims
        if fault_tolerant:
            self._parallel_dims = self._job_dims.replica_group()

    @override
    def setup_environment(self) -> None:
        _compat.setup_distributed(self)
        if self._parallel_dims is None:  # launched externally (torchrun): no launcher was configured here
            self.before_launch()
        mesh = self.parallel_dims.build_mesh(self.root_device.type)
        _compat.set_device_mesh(self, self.lightning_module, mesh)
        if self.parallelism.replicas.fault_tolerant:
            state = ReplicaState(self)
            self._replicas = state.start(self._job_dims, self._timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that share a data-parallel coordinate (tp / pp peers) must read the same batches; under torchft each
        # replica group reads its share of the whole job's global batch.
        dims, group = self.parallel_dims, self.parallelism.replicas.group or 0
        groups = self._job_dims.dp_replicate if self._replicas is not None and self._job_dims is not None else 1
        return {"num_replicas": dims.dp_size * groups, "rank": group * dims.dp_size + dims.dp_rank(self.global_rank)}

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # A model whose module can initialize any part of it (reset_parameters) is built on the meta device: each rank
        # materializes just its own stages / shards (parallel/materialize.py). Without that hook it is built for real,
        # drawing the same random numbers as one process, and each rank keeps its part's values.
        if empty_init is None:
            empty_init = contract.module_hook(self.lightning_module, "reset_parameters") is not None
        with super().tensor_init_context(empty_init=empty_init):
            yield

    # ---------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._take_over_clipping(trainer)
        self._loaders.take_over(trainer)
        # DTensor does not support inference tensors: validation runs under no_grad instead of inference_mode.
        _compat.disable_inference_mode(trainer)
        if self._laid_out is None:  # once: validate / test / predict after fit reuse the layout
            self._lay_out_module()
        self.metrics.sync_over_data_parallel(self.lightning_module)
        _compat.materialize_distributed_module(self.model, self.root_device)
        self.barrier()
        # Lightning's own set-up (precision, device, optimizers and, in setup_optimizers, DiLoCo), not
        # ModelParallelStrategy's: it requires a configure_model hook, which our layouts do not.
        Strategy.setup(self, trainer)

    def _take_over_clipping(self, trainer: pl.Trainer) -> None:
        """Lightning's clipping sees one shard / one stage; the step clips by the norm over all axes instead
        (:func:`lightning_dist.parallel.step.finish_gradients`)."""
        name = type(self).__name__
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: {name} clips by the global norm only; "
                "use gradient_clip_algorithm='norm'."
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            # A pipeline schedule runs backward itself, and the norm over all axes is clipped before the scaler
            # unscales: fp16 loss scaling would silently clip (and log) scaled gradients.
            raise ValueError(
                f"precision={self.precision_plugin.precision!r} uses a gradient scaler, which {name} does not apply; "
                "use precision='bf16-mixed' or '32-true'."
            )
        if trainer.gradient_clip_val is not None:
            self._clip_val, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None

    def _lay_out_module(self) -> None:
        """Lay the module out (:func:`~lightning_dist.parallel.lay_out.lay_out`) and gather every rank's layout once,
        for ``describe(all_ranks=True)`` (a small object per rank)."""
        module, dims = self.lightning_module, self.parallel_dims
        self._names = full.ModelNames.of(module)
        self._declared = contract.declared(module, dims, self.parallelism)
        self._laid_out = lay_out(
            module,
            dims,
            self.parallelism,
            self._declared,
            rank=self.global_rank,
            device=self.root_device,
            param_dtype=param_dtype_of(str(getattr(self.precision_plugin, "precision", ""))),  # FSDP2's compute dtype
        )
        self._layouts = [None] * self.world_size  # type: ignore[list-item]
        torch.distributed.all_gather_object(self._layouts, self._laid_out.layout)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._outer.build(self.model, self._declared.blocks, self.parallel_dims, self.optimizers)

    # ---------------------------------------------------------------------------------- the step (parallel/step.py)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._replicas is not None:  # the replica groups' quorum for this optimizer step (its first micro batch)
            self._replicas.begin_step()
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module predicts on this cp rank's part; outputs whose dim 1 is the local length are gathered whole."""
        batch = args[0] if args else kwargs.get("batch")
        outputs = self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs, loss=False)
        return step.whole_predictions(outputs, batch, self.parallel_dims)

    def _step(
        self,
        hook: str,
        precision_context: Callable[[], AbstractContextManager[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss: bool = True,
    ) -> Any:
        """Stages 1 and 2 of the step: this cp rank's part of the batch, then the module's own ``hook`` under loss
        parallelism; under pp on the pipeline's view of the module, whose ``compute_loss`` runs the schedule (forward
        and backward of every microbatch) and whose model call runs the pipeline forward."""
        dims = self.parallel_dims
        args, kwargs = step.local_step_args(args, kwargs, dims)
        with step.loss_context(dims, self.parallelism) if loss else nullcontext():
            pipeline = self.pipeline
            if pipeline is None:
                return getattr(super(), hook)(*args, **kwargs)  # Lightning's: its precision context, the module's hook
            with precision_context():
                return getattr(pipeline.routed, hook)(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        pipeline = self.pipeline
        if pipeline is None:
            with step.loss_context(self.parallel_dims, self.parallelism):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step; hand its gradients back instead of running a second
        # backward, keeping Lightning's hooks (on_before_backward / on_after_backward) in place.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning divides the loss by accumulate_grad_batches before backward; the schedule's gradients too.
        pipeline.restore_grads(scale=1.0 / module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient reduction on the accumulating micro-steps: FSDP2 keeps unsharded gradients until the last."""
        with step.no_gradient_sync(self.model):
            yield

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()  # stage 2: forward + backward of the step's last (or only) micro batch
        dims, trainer = self.parallel_dims, self.lightning_module.trainer
        # Stage 3, with the MoE routers' load over the global batch (the module balances its experts by it).
        load = self._declared.expert_load() if dims.dp_cp_size > 1 else ()
        norm = step.finish_gradients(
            self.model.parameters(),
            self._clip_val,
            expert_load=load,
            load_group=self.metrics.dp_group if load else None,
            pipeline=self.pipeline,
            replicas=self._replicas,
        )
        if _compat.logs_this_step(trainer):  # Lightning's log() costs ~0.5 ms of host time
            self.lightning_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        # Stage 4: the guarded update, then DiLoCo's outer step.
        number = trainer.global_step + 1
        return step.optimizer_step(
            partial(super().optimizer_step, optimizer, lambda: loss, model, **kwargs),
            optimizer,
            norm,
            loss,
            guard=self._nonfinite_guard,
            step=number,
            report=trainer.log_every_n_steps > 0 and number % trainer.log_every_n_steps == 0,
            on_device=NonFiniteGuard.decides_on_device(optimizer, getattr(self.precision_plugin, "scaler", None)),
            diloco=self._outer.diloco,
            replicas=self._replicas,
        )

    def pop_bubble_fraction(self) -> float | None:
        """This rank's pipeline idle fraction since the last call (``None`` without a pipeline or a step)."""
        pipeline = self.pipeline
        return pipeline.bubble.pop_fraction() if pipeline is not None else None

    # --------------------------------------------------------------------------------- data, metrics, loops
    @override
    def process_dataloader(self, dataloader: object) -> object:
        training = self.lightning_module.trainer.training
        return self._loaders.deal(dataloader, self.distributed_sampler_kwargs, training)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        reduced = self.metrics.reduce(tensor, group, reduce_op, super().reduce)
        mean = str(reduce_op).lower() in ("mean", "avg", "reduceop.avg")
        if self._replicas is not None and group is None and mean and isinstance(reduced, torch.Tensor):
            reduced = self._replicas.mean(reduced)  # a logged value: over the replica groups in the quorum too
        return reduced

    @override
    def on_train_start(self) -> None:
        self._cp_changes.redo()
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        self._cp_changes.redo()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._cp_changes.redo()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._cp_changes.redo()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._nonfinite_guard.report()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            pipeline = self.pipeline  # under pp the changes were made to the stages' views too
            self._cp_changes.undo([self.lightning_module, *(pipeline.views if pipeline is not None else ())])
        if self._metrics is not None:
            self._metrics.restore()
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        super().teardown()

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return checkpoint_io.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        path = Path(self.broadcast(filepath))
        if self._replicas is not None:  # the step count the replica groups agree on, to resume in step with them
            checkpoint["torchft"] = self._replicas.manager.state_dict()
        # Lightning's sharded layout; under DiLoCo each replica's own keys and the outer state (see outer_sync.py)
        state = checkpoint_io.sharded_state(checkpoint)
        state = self._outer.replica_state(state, checkpoint, self.parallel_dims, self.global_rank)
        if self.parallelism.float8 == "tensorwise":  # plain high-precision tensors, not torchao's float8 wrappers
            state = high_precision_state(state)
        if not self.async_save:
            checkpoint_io.save(state, checkpoint, path, self.global_rank)
            return
        if self._checkpoint_group is None:  # the background writes' collectives: a gloo group of their own
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        self.pending_save = checkpoint_io.save(state, checkpoint, path, self.global_rank, self._checkpoint_group)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint of any layout into this one, once its names and shapes are checked against the module's.

        A sharded folder is loaded here (:func:`lightning_dist.checkpoint.store.load_sharded`; under DiLoCo each
        replica's state: :class:`~lightning_dist.strategies.outer_sync.OuterSync`); a single file (one process's) is
        mapped and returned whole, for :meth:`load_model_state_dict` / :meth:`load_optimizer_state_dict`
        (:mod:`lightning_dist.checkpoint.full`). Lightning's own loader needs DTensor parameters and one model on
        every rank; pipeline ranks hold different parameters, plain tensors without TP or FSDP.

        Raises:
            ValueError: A tensor is missing, unexpected or of another shape (one line naming it).
        """
        if checkpoint_path == FROM_PEER and self._replicas is not None:  # a replaced replica group rejoins
            return ReplicaState(self).checkpoint_from_peer(self._replicas)
        path = Path(self.broadcast(checkpoint_path))
        strict = self.lightning_module.strict_loading
        self._single_file = not path.is_dir()
        if self._single_file:
            checkpoint = full.read(path, weights_only)
            full.check_module_fits(path, full.shapes_of(checkpoint, path), self._names, strict)
            return checkpoint
        full.check_module_fits(path, full.checkpoint_shapes(path), self._names, strict)
        rest = self._outer.load(
            path, self.model, self.optimizers, strict, weights_only, self.parallel_dims, self.global_rank
        )
        agreed = rest.pop("torchft", None)
        if agreed is not None and self._replicas is not None:
            self._replicas.manager.load_state_dict(agreed)
        return rest

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self._single_file  # a sharded folder's optimizer state was loaded in load_checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._single_file:
            full.load_model(self.model, checkpoint[full.MODEL_KEY], strict=strict)
            self._outer.reset()  # one file holds no replica's DiLoCo state

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        strict = self.lightning_module.strict_loading
        full.load_optimizers(self.model, self.optimizers, checkpoint["optimizer_states"], self._names, strict=strict)
