"""TensorParallelStrategy: tensor + sequence + loss parallelism composed with FSDP2 sharding or replication."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_dist import _compat
from lightning_dist.parallel.clip import clip_grad_norm_
from lightning_dist.parallel.compose import parallelize
from lightning_dist.parallel.tensor import TensorParallelPlan
from lightning_dist.parallel_dims import ParallelDims

_DEFAULT_TIMEOUT = timedelta(minutes=10)
_OPTIM_STATE_SAVE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
_OPTIM_STATE_LOAD = StateDictOptions(flatten_optimizer_state_dict=True)


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor parallelism (with sequence and loss parallelism) inside, FSDP2 or replication across.

    Example::

        Trainer(strategy=TensorParallelStrategy(tp=2, dp_shard=-1), devices=4)
        Trainer(strategy="tensor_parallel", devices=2)  # after `import lightning_dist`

    The model is parallelized after ``configure_model``: with ``plan`` when given, else with the module's
    ``tensor_parallel_plan(sequence_parallel=..., loss_parallel=...)`` method. A module whose ``configure_model``
    already made DTensor parameters (hand-written ``parallelize_module`` / ``fully_shard`` on ``self.device_mesh``)
    is left as it is. Checkpoints are sharded (``torch.distributed.checkpoint``) and resume exactly.

    Args:
        tp: Tensor-parallel degree.
        dp_shard: FSDP2 shard degree; ``-1`` = the rest of the world size.
        dp_replicate: Replica degree (HSDP when ``dp_shard > 1`` too); ``-1`` = the rest.
        sequence_parallel: Shard norms and residuals along the sequence.
        loss_parallel: Cross-entropy on vocab-sharded logits.
        plan: Module-name pattern -> ``ParallelStyle`` or ``"colwise"`` / ``"rowwise"`` / ``"sequence"``.
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        timeout: Collective timeout: a rank that stops answering ends the job after this long.
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        plan: TensorParallelPlan | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": 1}
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self._plan = plan
        self._parallel_dims: ParallelDims | None = None
        self._parallelized = False
        self._clip_val: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_plan: dict[str, str] = {}

    # --------------------------------------------------------------------------------------------------- layout
    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated layout; available once the number of processes is known."""
        if self._parallel_dims is None:
            raise RuntimeError(f"{type(self).__name__}.parallel_dims was read before the Trainer set up processes.")
        return self._parallel_dims

    def _resolve_dims(self) -> ParallelDims:
        degrees = dict(self._degrees)
        # tp=-1 means "all the devices the data-parallel degrees leave" (the Trainer(strategy="tensor_parallel")
        # default); ParallelDims itself only knows -1 on the dp axes.
        world_size = self.num_nodes * self.num_processes
        if degrees["tp"] == -1:
            dp = max(degrees["dp_replicate"], 1) * max(degrees["dp_shard"], 1) * degrees["pp"]
            degrees["tp"] = max(1, world_size // dp)
        return ParallelDims(world_size=world_size, **degrees)

    @override
    def _configure_launcher(self) -> None:
        # The number of processes is known here, before Lightning launches any: validate the layout now.
        self._parallel_dims = self._resolve_dims()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        if self._parallel_dims is None:
            self._parallel_dims = self._resolve_dims()
        self._device_mesh = self._parallel_dims.build_mesh(self.root_device.type)
        # LightningModule.device_mesh: a hand-written configure_model reads the axes from here.
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that share a data-parallel coordinate (tp / pp peers) must read the same batches.
        dims = self.parallel_dims
        return {"num_replicas": dims.dp_size, "rank": dims.dp_rank(self.global_rank)}

    # ---------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by {type(self).__name__}:"
                " the global batch is data.global_batch_size; set accumulate_grad_batches=1."
            )
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: {type(self).__name__} clips by the "
                "global norm only; use gradient_clip_algorithm='norm'."
            )
        # Lightning's clipping sees one shard / one stage; we clip by the norm over all axes (see backward).
        if trainer.gradient_clip_val is not None:
            self._clip_val, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None
        # DTensor does not support inference tensors: validation runs under no_grad instead of inference_mode.
        _compat.disable_inference_mode(trainer)
        if not self._parallelized:
            self._parallelize(self.lightning_module)
            self._parallelized = True
        _compat.materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: pl.LightningModule) -> None:
        dims = self.parallel_dims
        if any(isinstance(p, DTensor) for p in module.parameters()):
            return  # parallelized by hand in configure_model
        check = getattr(module, "check_tensor_parallel", None)
        if dims.tp_enabled and callable(check):
            check(dims.tp, sequence_parallel=self.sequence_parallel)
        self.applied_plan = parallelize(
            module,
            dims,
            tp_plan=self._tensor_parallel_plan(module) if dims.tp_enabled else None,
            fsdp_units=_fsdp_units(module),
            param_dtype=_compute_dtype(self.precision_plugin),
        )

    def _tensor_parallel_plan(self, module: nn.Module) -> TensorParallelPlan:
        if self._plan is not None:
            return self._plan
        method = getattr(module, "tensor_parallel_plan", None)
        if method is None:
            raise ValueError(
                f"tp={self.parallel_dims.tp} but {type(module).__name__} has no tensor-parallel plan; pass "
                "TensorParallelStrategy(plan={'layers.*.q_proj': 'colwise', ...}), define "
                "tensor_parallel_plan() on the module, or parallelize it by hand in configure_model."
            )
        return method(sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # Flattened: one key per parameter ("state.layers.0.w.exp_avg", "param_groups.layers.0.w.lr"). Lightning's
        # nested form has one "param_groups" entry per optimizer, which DCP keeps from a single rank; pipeline ranks
        # hold different parameters, so the others would lose their groups on load (torchtitan flattens too).
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=_OPTIM_STATE_SAVE)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (a folder written by ``torch.distributed.checkpoint``) into this layout.

        Lightning's own loader only accepts models with DTensor parameters; a pipeline stage without TP or FSDP has
        plain tensors, and each rank holds only its stages' parameters. Both are read here the same way: every rank
        asks DCP for exactly the keys its model and optimizers hold, under the full model's names.
        """
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)  # a full (single-file) checkpoint
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for idx, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{idx}"] = get_optimizer_state_dict(self.model, optimizer, options=_OPTIM_STATE_LOAD)
        dcp.load(state, checkpoint_id=path)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))
        for idx, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_STATE_LOAD)
        return torch.load(path / _compat.checkpoint_metadata_file(), weights_only=weights_only)

    # ------------------------------------------------------------------------------------------------- training
    @contextmanager
    def _loss_context(self) -> Generator[None, None, None]:
        """Loss parallelism must wrap the loss's forward and its backward."""
        use = self.loss_parallel and self.parallel_dims.tp_enabled
        with loss_parallel() if use else nullcontext():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # The loss of a loss-parallel step is a replicated DTensor; Lightning's sync_dist reduces plain tensors.
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._loss_context():
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._clip_and_log_grad_norm()
        return loss

    def _clip_and_log_grad_norm(self) -> None:
        """Clip by the norm over all axes (one number for the whole model) and log it as ``train/grad_norm``."""
        norm = clip_grad_norm_(self.model.parameters(), self._clip_val, self._pp_group())
        self.last_grad_norm = norm
        self.lightning_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def _pp_group(self):
        return None


def _fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 wraps one by one: the module's pipeline block container, when it declares one."""
    spec = getattr(module, "pipeline_spec", None)
    if spec is None:
        return []
    pipeline_spec = spec()
    blocks = pipeline_spec.blocks(pipeline_spec.model(module))
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def _compute_dtype(precision_plugin: Any) -> torch.dtype | None:
    """FSDP2's parameter dtype for Lightning's ``*-mixed`` precision (``None`` = keep the parameter dtype)."""
    precision = str(getattr(precision_plugin, "precision", ""))
    if precision == "bf16-mixed":
        return torch.bfloat16
    if precision == "16-mixed":
        return torch.float16
    return None
