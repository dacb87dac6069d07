"""DataParallelStrategy: Lightning's DDPStrategy, with a user's own DataLoaders kept in the one-process order and the
step's last stages (:mod:`lightning_dist.parallel.step`) as every strategy of ours runs them."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from typing_extensions import override

from lightning_dist import _compat, contract
from lightning_dist.parallel import step
from lightning_dist.parallel.compose import apply_block_options
from lightning_dist.parallel.declared import Declared
from lightning_dist.parallel.float8 import apply_float8
from lightning_dist.parallel.guard import NonFiniteGuard
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies.loaders import LoaderDealer


class DataParallelStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` (its C++ reducer, its hooks), except for data order: a loader's own sampler is
    dealt out by rank (global batch k = one process's batch k at world-size x the batch) instead of being replaced
    by a shuffling ``DistributedSampler``. The app's ``parallelism=ddp``. As the mesh strategies, it clips by the
    norm the non-finite guard checks and logs it as ``train/grad_norm`` on logging steps, and applies float8,
    activation checkpointing and ``torch.compile`` to the blocks the module declares before DDP wraps the model.

    Args:
        args: Lightning's ``DDPStrategy`` arguments.
        parallelism: How the blocks train (``float8``, ``activation_checkpointing``, ``compile``, ``loss_chunks``) and
            DDP's gradient compression (``ddp.comm_hook``); a layout's other options are refused.
        on_nonfinite: A step whose gradient norm is NaN / Inf: ``stop`` the run, or ``skip`` the update.
        kwargs: Lightning's ``DDPStrategy`` keyword arguments (``process_group_backend``, ``timeout``, ...).
    """

    strategy_name = "data_parallel"
    #: Sums the MoE routers' token counts over the ranks each step (``step.finish_gradients``).
    sums_expert_load = True

    def __init__(
        self, *args: Any, parallelism: Parallelism | None = None, on_nonfinite: str = "stop", **kwargs: Any
    ) -> None:
        self.parallelism = parallelism or Parallelism()
        _refuse_mesh_options(self.parallelism, type(self).__name__)
        super().__init__(*args, **kwargs)
        self._nonfinite_guard = NonFiniteGuard(on_nonfinite, warn=rank_zero_warn)
        self._loaders = LoaderDealer()
        self._declared = Declared()
        self._blocks_done = False
        self._clip_val: float | None = None

    @property
    def nonfinite_guard(self) -> NonFiniteGuard:
        """This strategy's non-finite guard (``on_nonfinite``)."""
        return self._nonfinite_guard

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.parallelism.ddp.comm_hook is not None:
            # Registered here on every device: Lightning registers its ddp_comm_hook argument on CUDA only.
            self.model.register_comm_hook(*comm_hook(self.parallelism.ddp.comm_hook))

    @override
    def setup_environment(self) -> None:
        _compat.init_after_torchrun_restart(self)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._loaders.take_over(trainer)
        # The guard needs the gradient norm anyway: clip with it rather than let Lightning compute it a second time
        # (a foreach norm over every gradient: ~3% of a d_model 256 step on CPU). Only for Lightning's own norm
        # clipping: a module that clips its own way (configure_gradient_clipping) or by value is left to Lightning.
        self._clip_val = None
        by_norm = trainer.gradient_clip_algorithm in (None, GradClipAlgorithmType.NORM)
        own = is_overridden("configure_gradient_clipping", trainer.lightning_module)
        if trainer.gradient_clip_val is not None and by_norm and not own:
            self._clip_val, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None
        # A whole model on every rank: no axis splits it (one process's degrees).
        self._declared = contract.declared(trainer.lightning_module, ParallelDims(world_size=1), self.parallelism)
        options = self.parallelism
        per_block = options.compile or options.activation_checkpointing.mode != "none" or options.float8 != "off"
        if per_block and not self._blocks_done:  # once: a later validate / test reuses the compiled blocks
            blocks = self._declared.blocks
            if options.float8 != "off":  # first, as in every mesh layout (parallel/compose.py)
                apply_float8(blocks, options.float8, self.root_device.type, fsdp=False)
            apply_block_options(blocks, options)
            self._blocks_done = True
        super().setup(trainer)  # DDP wraps the model: its hooks stay outside the compiled blocks

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()
        trainer = self.lightning_module.trainer
        # Stage 3 of the step: DDP's gradients are all-reduced already (the same on every rank); the MoE routers'
        # load is summed over every rank, for the module's balancing.
        load = self._declared.expert_load() if self.world_size > 1 else ()
        norm = step.finish_gradients(self.lightning_module.parameters(), self._clip_val, expert_load=load)
        if _compat.logs_this_step(trainer):  # as the mesh strategies
            self.lightning_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
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
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        training = self.lightning_module.trainer.training
        return self._loaders.deal(dataloader, self.distributed_sampler_kwargs, training)

    @override
    def on_train_end(self) -> None:
        self._nonfinite_guard.report()
        super().on_train_end()


def _refuse_mesh_options(options: Parallelism, name: str) -> None:
    """What Lightning's DDP cannot do, refused in one line rather than ignored."""
    if options.diloco_enabled:  # Lightning's reducer averages every step: it cannot leave replicas apart
        raise ValueError(
            f"{name} averages gradients every step, so parallelism.sync=diloco cannot run on it; use "
            "MeshStrategy(dp_replicate=..., sync='diloco') or parallelism.sync=every_step."
        )
    if options.fsdp.reduce_dtype is not None:
        raise ValueError(
            f"parallelism.fsdp.reduce_dtype={options.fsdp.reduce_dtype!r} is FSDP2's; Lightning's DDP compresses its "
            "all-reduce with parallelism.ddp.comm_hook='bf16' (or fp16, powersgd)."
        )
    if options.fsdp.cpu_offload:
        raise ValueError(
            "parallelism.fsdp.cpu_offload=true offloads FSDP2 shards; Lightning's DDP holds none: use MeshStrategy."
        )


def comm_hook(name: str) -> tuple[Any, Any]:
    """``(state, hook)`` of torch's DDP communication hook ``name`` (``bf16``, ``fp16``, ``powersgd``), over DDP's
    own process group (``state=None``; PowerSGD's state with torch's defaults: rank 1, error feedback, 1000 warm-up
    steps of plain all-reduce)."""
    if name == "powersgd":
        return powerSGD_hook.PowerSGDState(process_group=None), powerSGD_hook.powerSGD_hook
    return None, {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[name]
