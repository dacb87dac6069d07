"""DataParallelStrategy: Lightning's DDPStrategy, with a user's own DataLoaders kept in the one-process order."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from typing_extensions import override

from lightning_dist import _compat
from lightning_dist.contract import configure_loss_chunks, declared_blocks
from lightning_dist.parallel.clip import global_grad_norm
from lightning_dist.parallel.compose import apply_block_options
from lightning_dist.parallel.float8 import apply_float8
from lightning_dist.parallel.options import ParallelOptions
from lightning_dist.strategies.guard import GuardedStrategyMixin
from lightning_dist.strategies.loaders import LoaderOrderMixin
from lightning_dist.strategies.metrics import sum_expert_load


class DataParallelStrategy(GuardedStrategyMixin, LoaderOrderMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` (its C++ reducer, its hooks), except for data order: a loader's own sampler is
    dealt out by rank (global batch k = one process's batch k at world-size x the batch) instead of being replaced
    by a shuffling ``DistributedSampler``. The app's ``parallelism=ddp``. As the mesh strategies, it clips by the
    norm the non-finite guard computes and logs it as ``train/grad_norm`` on logging steps, and applies activation
    checkpointing and ``torch.compile`` to the blocks the module's ``pipeline_spec()`` names (``options``) before
    DDP wraps the model.
    """

    strategy_name = "data_parallel"

    #: Sums the MoE routers' token counts over the ranks each step (``metrics.sum_expert_load``).
    sums_expert_load = True

    def __init__(
        self, *args: Any, options: ParallelOptions | None = None, on_nonfinite: str | None = None, **kwargs: Any
    ) -> None:
        # Of the layout options, Lightning's DDP takes the non-finite guard and the process-group settings.
        fields = {"on_nonfinite": on_nonfinite} if on_nonfinite is not None else {}
        self.options = ParallelOptions.build(options, **fields)
        if self.options.diloco:  # Lightning's reducer averages every step: it cannot leave replicas apart
            raise ValueError(
                f"{type(self).__name__} averages gradients every step, so sync=diloco cannot run on it; use "
                "MeshStrategy(dp_replicate=..., sync='diloco') or sync=every_step."
            )
        if self.options.reduce_dtype is not None:
            raise ValueError(
                f"reduce_dtype={self.options.reduce_dtype!r} is FSDP2's; Lightning's DDP compresses its all-reduce "
                "with ddp_comm_hook='bf16' (or fp16, powersgd)."
            )
        if self.options.cpu_offload:
            raise ValueError("cpu_offload=true offloads FSDP2 shards; Lightning's DDP holds none: use MeshStrategy.")
        kwargs.setdefault("process_group_backend", self.options.process_group_backend)
        kwargs.setdefault("timeout", self.options.timeout)
        super().__init__(*args, **kwargs)
        self._blocks_done = False

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.options.ddp_comm_hook is not None:
            # Registered here on every device: Lightning registers its ddp_comm_hook argument on CUDA only.
            self.model.register_comm_hook(*comm_hook(self.options.ddp_comm_hook))

    @override
    def setup_environment(self) -> None:
        _compat.init_after_torchrun_restart(self)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.take_over_loaders(trainer)
        # The guard needs the gradient norm anyway: clip with it rather than let Lightning compute it a second time
        # (a foreach norm over every gradient: ~3% of a d_model 256 step on CPU). Only for Lightning's own norm
        # clipping: a module that clips its own way (configure_gradient_clipping) or by value is left to Lightning.
        self._clip_val = None
        by_norm = trainer.gradient_clip_algorithm in (None, GradClipAlgorithmType.NORM)
        own = is_overridden("configure_gradient_clipping", trainer.lightning_module)
        if trainer.gradient_clip_val is not None and by_norm and not own:
            self._clip_val, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None
        configure_loss_chunks(trainer.lightning_module, self.options.loss_chunks)
        options = self.options
        per_block = options.compile or options.activation_checkpointing != "none" or options.float8 != "off"
        if per_block and not self._blocks_done:  # once: a later validate / test reuses the compiled blocks
            blocks = declared_blocks(trainer.lightning_module)
            if options.float8 != "off":  # first, as in every mesh layout (parallel/compose.py)
                apply_float8(blocks, options.float8, self.root_device.type, fsdp=False)
            apply_block_options(blocks, options)
            self._blocks_done = True
        super().setup(trainer)  # DDP wraps the model: its hooks stay outside the compiled blocks

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()
        if self.world_size > 1:  # the MoE routers' load over the global batch, for the module's balancing
            sum_expert_load(self.lightning_module)
        params = [p for p in self.lightning_module.parameters() if p.grad is not None]
        norm = global_grad_norm(params)  # all-reduced gradients: the same on every rank
        if self._clip_val is not None and params:
            torch.nn.utils.clip_grads_with_norm_(params, self._clip_val, norm, foreach=True)
        if _compat.logs_this_step(self.lightning_module.trainer):  # as the mesh strategies
            self.lightning_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        apply = partial(super().optimizer_step, optimizer, lambda: loss, model, **kwargs)
        return self.nonfinite_guard.optimizer_step(optimizer, norm, loss, self.lightning_module, apply)


def comm_hook(name: str) -> tuple[Any, Any]:
    """``(state, hook)`` of torch's DDP communication hook ``name`` (``bf16``, ``fp16``, ``powersgd``), over DDP's
    own process group (``state=None``; PowerSGD's state with torch's defaults: rank 1, error feedback, 1000 warm-up
    steps of plain all-reduce)."""
    if name == "powersgd":
        return powerSGD_hook.PowerSGDState(process_group=None), powerSGD_hook.powerSGD_hook
    return None, {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[name]
