"""Every private torch / Lightning / transformers API lightning-dist touches, in one place.

When one of these moves in a new release, this is the only file to change.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

# transformers' private APIs live in a module of their own, read through this one (_compat.attn_implementation, ...)
from lightning_dist._compat_hf import attn_implementation as attn_implementation
from lightning_dist._compat_hf import hf_init_weights as hf_init_weights
from lightning_dist._compat_hf import hf_natural_key as hf_natural_key
from lightning_dist._compat_hf import hf_no_split_modules as hf_no_split_modules
from lightning_dist._compat_hf import hf_rename_source_key as hf_rename_source_key
from lightning_dist._compat_hf import hf_supported_attention as hf_supported_attention
from lightning_dist._compat_hf import hf_weight_transforms as hf_weight_transforms
from lightning_dist._compat_hf import set_attn_implementation as set_attn_implementation

# torch.distributed.pipelining's private parts: a module of their own too (_compat.reshape_pipeline, ...)
from lightning_dist._compat_pipelining import PIPELINE_METADATA_INFERENCE as PIPELINE_METADATA_INFERENCE
from lightning_dist._compat_pipelining import PIPELINE_STAGE_CHUNKS as PIPELINE_STAGE_CHUNKS
from lightning_dist._compat_pipelining import around_pipeline_metadata_inference as around_pipeline_metadata_inference
from lightning_dist._compat_pipelining import follow_train_eval_switch as follow_train_eval_switch
from lightning_dist._compat_pipelining import infers_stage_shapes_on_real_tensors as infers_stage_shapes_on_real_tensors
from lightning_dist._compat_pipelining import pipeline_outputs_only as pipeline_outputs_only
from lightning_dist._compat_pipelining import pipeline_stage as pipeline_stage
from lightning_dist._compat_pipelining import reshape_pipeline as reshape_pipeline
from lightning_dist._compat_pipelining import schedule_loss_kwargs as schedule_loss_kwargs
from lightning_dist._compat_pipelining import stage_inputs as stage_inputs
from lightning_dist._compat_pipelining import wrap_stage_chunks as wrap_stage_chunks

# transformers' private APIs: a module of their own, read through this one (_compat.attn_implementation, ...)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    """Flatten ``axes`` of ``mesh`` into one axis ``name`` reachable as ``mesh[name]``.

    ``DeviceMesh._flatten`` is private in torch 2.6-2.13; torchtitan uses the same call for its ``dp`` axis."""
    return mesh[axes if len(axes) > 1 else axes[0]]._flatten(name)


def disable_inference_mode(trainer) -> None:
    """Run Lightning's validation, test and predict loops under ``no_grad`` instead of ``inference_mode``.

    DTensor rejects inference tensors; ``Trainer(inference_mode=False)`` does the same for every loop, but a
    strategy cannot change the Trainer's constructor arguments, so it flips the loops' private flag."""
    loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    for loop in loops:
        loop.inference_mode = False


def logs_this_step(trainer: Any) -> bool:
    """Whether the optimizer step now running sends its logged values to the loggers.

    Lightning's own rule (``_LoggerConnector.should_update_logs``, counted by the private ``_batches_that_stepped``)
    plus ``fast_dev_run`` and the last step of ``max_steps`` (so ``callback_metrics`` end with the last step's). The
    same answer in ``training_step``, the strategy's ``optimizer_step`` and ``on_train_batch_end`` of one step."""
    if trainer.fast_dev_run or trainer._logger_connector.should_update_logs:
        return True
    return 0 < trainer.max_steps <= trainer.fit_loop.epoch_loop._batches_that_stepped + 1


def skip_sigterm_broadcast(trainer: Any) -> Callable[[], None]:
    """Turn off the SIGTERM check Lightning's training loop makes before every batch; returns the undo.

    Lightning 2.6 broadcasts rank 0's ``trainer.received_sigterm`` and reads it back before each batch
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a blocking collective and a host read per step. Our callback
    agrees on signals itself (``callbacks/preemption.py``), so it is dropped for this trainer's loop only."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return lambda: None
    loop._broadcast_sigterm_tensor = lambda: None  # an instance attribute shadows the method

    def undo() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return undo


def materialize_distributed_module(module, device) -> None:
    """Lightning's own materialization of meta-device parameters (used by its ModelParallelStrategy)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers, device) -> None:
    """Lightning's helper that moves optimizer state to ``device``."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def step_supports_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` honours ``optimizer.found_inf`` (a float tensor, 1.0 = skip the update).

    torch's fused optimizers (``AdamW(fused=True)``, ``Adam``, ``SGD``, ``Adagrad``) set the private
    ``_step_supports_amp_scaling`` that ``GradScaler.step`` reads; their kernels then skip the update on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def functional_collectives_module() -> ModuleType:
    """``torch.distributed._functional_collectives`` (private): the module DTensor calls as ``funcol.<name>``.

    DTensor looks the functions up on this module at call time (``funcol.all_reduce``, ``all_gather_single``,
    ``reduce_scatter_single`` in torch 2.13; ``all_gather_tensor``, ``reduce_scatter_tensor`` in 2.11), so the
    communication tracker replaces them while it is installed (its names: ``telemetry/torch_patches.py``)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def wait_functional_collective(tensor: torch.Tensor) -> torch.Tensor:
    """Block until the functional collective that produced ``tensor`` finished; return the plain result.

    ``AsyncCollectiveTensor.wait()`` and ``funcol.wait_tensor`` are both in the private module. On CPU this blocks the
    host; on CUDA it makes the current stream wait for the collective's stream."""
    import torch.distributed._functional_collectives as funcol

    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return funcol.wait_tensor(tensor)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = every rank's ``input`` along dim 0: ``dist.all_gather_single`` (torch 2.13), else the name it
    deprecates, ``all_gather_into_tensor`` (torch 2.11; same arguments). Looked up at each call, not bound once: the
    telemetry's CommTracker counts the traffic by replacing torch.distributed's functions while it is installed."""
    import torch.distributed as dist

    fn = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter_sum_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = this rank's dim-0 slice of ``input`` summed over ranks: ``dist.reduce_scatter_single`` (torch
    2.13), else ``reduce_scatter_tensor`` (torch 2.11), looked up at each call as :func:`all_gather_single`."""
    import torch.distributed as dist

    fn = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (``c10d._resolve_process_group``, private).

    Functional collectives identify groups by name (a DeviceMesh axis passes ``mesh._dim_group_names[dim]``); the
    tracker maps the names of the mesh axes it knows directly and needs this only for a group it has not seen."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def checkpoint_metadata_file() -> str:
    """The file in a Lightning sharded checkpoint folder that holds everything but model and optimizer state."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME as NAME

    return NAME


def run_atexit_handlers() -> None:
    """Run the interpreter's ``atexit`` handlers now (``atexit._run_exitfuncs``, private to CPython).

    The launcher ends a finished rank with ``os._exit`` (gloo's destructors can abort a shutdown); the handlers (W&B's,
    logging's) must still run first."""
    import atexit

    atexit._run_exitfuncs()


# ------------------------------------------------------------------------------------------- Lightning strategies
class BeforeLaunchHook:
    """Base of a Lightning strategy whose ``before_launch()`` (its own method) runs once the number of processes is
    known, before any process is launched (so a bad layout fails once, in the launching process).

    Lightning has no public hook there; ``Strategy._configure_launcher`` (private) is where the accelerator connector
    hands the strategy its devices and asks for a launcher.
    """

    def _configure_launcher(self) -> None:
        self.before_launch()  # type: ignore[attr-defined]
        super()._configure_launcher()  # type: ignore[misc]


def setup_distributed(strategy: Any) -> None:
    """``ModelParallelStrategy._setup_distributed`` (private): init the process group, set ranks and the device."""
    init_after_torchrun_restart(strategy)
    strategy._setup_distributed()


def init_after_torchrun_restart(strategy: Any) -> None:
    """After a torchrun restart, init the process group on a store prefixed by the attempt (Lightning then skips it).

    torchrun's agent keeps one TCPStore for every attempt (``TORCHELASTIC_USE_AGENT_STORE``) and torch 2.13's
    ``env://`` no longer prefixes keys by attempt: a restarted rank could read the dead attempt's gloo addresses."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    timeout = getattr(strategy, "_timeout", None) or timedelta(minutes=10)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=strategy._get_process_group_backend(),
        store=dist.PrefixStore(f"/lightning_dist/attempt_{attempt}", client),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def set_device_mesh(strategy: Any, module: Any, mesh: DeviceMesh) -> None:
    """Publish ``mesh`` where Lightning reads it: ``strategy.device_mesh`` (``strategy=None``: no strategy, a traced
    rank) and ``LightningModule.device_mesh``.

    Both are read-only views of private attributes ``ModelParallelStrategy.setup_environment`` sets to its own mesh."""
    if strategy is not None:
        strategy._device_mesh = mesh
    module._device_mesh = mesh


def fsdp_offload_policy(module: Any) -> Any:
    """The offload policy FSDP2 applied to ``module`` (an ``FSDPModule``); read from its private parameter group."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group.offload_policy if group is not None else None


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of ``world_size`` on torch's ``fake`` backend (its store: private, in
    ``torch.testing._internal.distributed.fake_pg``): collectives return at once, moving nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_tensor_mode(**kwargs: Any) -> Any:
    """``FakeTensorMode(**kwargs)`` (``torch._subclasses.fake_tensor``, private, since torch 2.0; torch's tracing and
    ``torch.distributed._tools`` build on it): tensors with shape, dtype and device but no storage, on which the
    planner steps an optimizer of any size."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def mem_tracker() -> Any:
    """A new ``MemTracker`` (``torch.distributed._tools.mem_tracker``, private, since torch 2.5): follows every tensor
    a step creates, by module, and the peak of what is alive; under :func:`fake_tensor_mode` nothing is allocated."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def record_cuda_memory_history(max_entries: int) -> None:
    """Record CUDA allocations with their stacks, the newest ``max_entries`` kept (``_record_memory_history``)."""
    from torch.cuda.memory import _record_memory_history

    _record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the history and the allocator's state to ``path`` (``_dump_snapshot``; https://pytorch.org/memory_viz)."""
    from torch.cuda.memory import _dump_snapshot

    _dump_snapshot(path)


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (private): a mode that sees every op's outputs."""
    return __import__("torch.utils._python_dispatch", fromlist=["TorchDispatchMode"]).TorchDispatchMode


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row group ``g`` of ``x`` (the rows up to ``offsets[g]``) times ``weight[g]``: ``torch.nn.functional.grouped_mm``
    where torch has it (2.13), else the private ``torch._grouped_mm`` it wraps (earlier torch)."""
    import torch
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", torch._grouped_mm)(x, weight, offs=offsets)


# --------------------------------------------------------------------------------------------- nn.Module surgery
def module_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The live (mutable) dict of ``module``'s children, ``nn.Module._modules``, in registration order: pipeline
    splitting deletes blocks by key and sets parts a stage does not own to ``None`` (``named_children`` skips them)."""
    return module._modules


def shallow_clone(module: nn.Module) -> nn.Module:
    """A new module object of the same class sharing ``module``'s children and parameters.

    Each of the clone's dicts (children, parameters, hooks) is a copy, so editing the clone's children or putting
    hooks on it leaves ``module`` as it was. Built with ``object.__new__`` because ``__init__`` would build new
    layers; ``copy.copy`` would share the dicts.
    """
    clone = object.__new__(type(module))
    clone.__dict__ = {key: type(val)(val) if isinstance(val, dict) else val for key, val in vars(module).items()}
    return clone


# ----------------------------------------------------------------------------------------------- Lightning data
def take_over_distributed_sampler(trainer: Any) -> bool:
    """Turn off Lightning's sampler injection for ``trainer``; return whether it was on (``use_distributed_sampler``).

    The flag lives on the Trainer's private accelerator connector. A strategy that shards loaders itself (in
    ``process_dataloader``) must keep Lightning from putting its own shuffling ``DistributedSampler`` in front first.
    """
    connector = trainer._accelerator_connector
    was_on = bool(connector.use_distributed_sampler)
    connector.use_distributed_sampler = False
    return was_on


def predict_batch_sampler(dataloader: Any) -> Any | None:
    """The ``BatchSampler`` inside the index-recording wrapper Lightning puts on a predict loader, else ``None``.

    Lightning's predict loop re-creates the loader with its batch sampler wrapped (``_IndexBatchSamplerWrapper``,
    for ``BasePredictionWriter``'s batch indices), so the loader has no ``batch_size`` of its own.
    """
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper

    wrapper = dataloader.batch_sampler
    return wrapper._batch_sampler if isinstance(wrapper, _IndexBatchSamplerWrapper) else None


def set_predict_sampler(dataloader: Any, sampler: Any) -> None:
    """Give the predict loader's wrapped ``BatchSampler`` a new sampler (the wrapper keeps a copy of its attributes;
    both are Lightning's fresh objects for this loop, not the user's)."""
    wrapper = dataloader.batch_sampler
    wrapper._batch_sampler.sampler = wrapper.sampler = sampler


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """Lightning's re-instantiation of a (possibly subclassed) DataLoader with a new sampler, other arguments kept."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


# -------------------------------------------------------------------------------------------- Lightning loggers
def set_csv_columns(writer: Any, columns: list[str]) -> None:
    """Make a ``CSVLogger``'s writer (``logger.experiment``) append rows under ``columns`` (the header kept on disk).

    The writer's class is Lightning's ``lightning.fabric.loggers.csv_logs._ExperimentWriter`` (private, the base of
    ``lightning.pytorch``'s ``ExperimentWriter``); its ``metrics_keys`` list is the header it writes and extends.
    """
    writer.metrics_keys = sorted(columns)


def wandb_experiment(logger: Any) -> Any | None:
    """A ``WandbLogger``'s W&B run if it was started, else ``None`` (reading ``logger.experiment`` would start it)."""
    return logger._experiment


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """The (mutable) keyword arguments a ``WandbLogger`` hands ``wandb.init`` when it starts its run."""
    return logger._wandb_init


def torch_ring_attention(on: bool, rotate: str = "allgather") -> None:
    """Route SDPA on DTensors sharded on dim 2 to torch's ring attention (CUDA's flash / efficient / cuDNN kernels, the
    head-tail load-balanced causal schedule, K/V passed by ``allgather`` or ``alltoall``), or stop (``on=False``):
    private in torch 2.13 (``torch.distributed.tensor.experimental._context_parallel``); torchtitan's calls."""
    from torch.distributed.tensor.experimental import _attention as cp

    cp.set_rotate_method(rotate)  # both read by every ring call, forward and backward (off: torch's defaults again)
    cp._cp_options.enable_load_balance = True
    (cp._enable_context_parallel_dispatcher if on else cp._disable_context_parallel_dispatcher)()


# ----------------------------------------------------------------------------------------------------------- submitit
def slurm_executor_anywhere(folder: Any) -> Any:
    """A ``submitit.SlurmExecutor`` built where SLURM is absent (its ``__init__`` refuses without ``srun``), only to
    render the sbatch script of a dry run; ``affinity`` is the classmethod that looks for ``srun``."""
    import submitit

    class _DryRun(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1

    return _DryRun(folder)


def sbatch_script(executor: Any) -> str:
    """The sbatch script submitit would submit (``SlurmExecutor._make_submission_file_text``, private)."""
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def training_state(trainer: Any) -> dict[str, Any]:
    """Lightning's checkpoint without the model and optimizer tensors: the loops' progress, the callbacks' and
    datamodule's states, the LR schedulers, the epoch and global step (``_CheckpointConnector._get_loops_state_dict``
    and ``call._call_callbacks_state_dict`` are private). What a replaced replica group takes from a live peer to
    resume its loop where the peer's is (:mod:`lightning_dist.strategies.replica_state`)."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer import call

    state = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "loops": trainer._checkpoint_connector._get_loops_state_dict(),
        "callbacks": call._call_callbacks_state_dict(trainer),
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "state_dict": {},
        "optimizer_states": [],
    }
    datamodule = trainer.datamodule
    if datamodule is not None:
        state[type(datamodule).__qualname__] = datamodule.state_dict()
    return state
