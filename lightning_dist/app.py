"""What the training app builds: the checks made before any process starts, and the run on each rank."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from lightning_dist.config import TrainConfig
from lightning_dist.parallel_dims import ParallelDims

#: ``parallelism.strategy`` -> the degrees it cannot do, each with the fix. ``ddp`` is Lightning's DDPStrategy;
#: every other name is our MeshStrategy, whose path follows from the degrees alone.
_CANNOT_DO: dict[str, dict[str, str]] = {
    "ddp": {
        "tp": "use parallelism=tp or parallelism=tp_fsdp for tensor parallelism",
        "pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines",
        "dp_shard": "use parallelism=fsdp to shard",
    },
    "fsdp": {
        "tp": "use parallelism=tp or parallelism=tp_fsdp for tensor parallelism",
        "pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines",
    },
    "tensor_parallel": {"pp": "use parallelism=pp (or parallelism=3d with tp) for pipelines"},
    "pipeline_parallel": {},
}
_DOES = {
    "ddp": "dp_replicate",
    "fsdp": "dp_shard (FSDP2), dp_replicate (HSDP)",
    "tensor_parallel": "dp_replicate, dp_shard, tp",
    "pipeline_parallel": "dp_replicate, dp_shard, tp, pp",
}


def build_parallel_dims(cfg: TrainConfig) -> ParallelDims:
    """The layout of ``cfg`` over ``cluster.devices x cluster.num_nodes`` processes, validated."""
    par = cfg.parallelism
    return ParallelDims(
        world_size=cfg.cluster.devices * cfg.cluster.num_nodes,
        dp_replicate=par.dp_replicate,
        dp_shard=par.dp_shard,
        tp=par.tp,
        pp=par.pp,
        cp=par.cp,
    )


def check_config(cfg: TrainConfig) -> ParallelDims:
    """Every check that can be made before processes start; each failure is one line with the value and the fix.

    Also settles what depends on this machine (``cluster.accelerator=auto``, the progress bar). Returns the layout,
    which the ranks are given as it is.
    """
    from lightning_dist.builders import check_model_and_data, resolve_micro_batch
    from lightning_dist.cluster import check_devices, check_submission, resolve_accelerator
    from lightning_dist.resume import check_run
    from lightning_dist.slurm import should_submit

    par, cluster = cfg.parallelism, cfg.cluster
    check_run(cfg)
    if par.strategy not in _CANNOT_DO:
        raise ValueError(f"parallelism.strategy={par.strategy!r} is unknown; use one of {sorted(_CANNOT_DO)}.")
    cluster.accelerator = resolve_accelerator(cluster.accelerator)
    if cluster.launcher not in ("local", "slurm"):
        raise ValueError(f"cluster.launcher={cluster.launcher!r} is unknown; use local or slurm.")
    if should_submit(cfg):
        check_submission(cluster)  # the login node: its own hardware says nothing about the compute nodes
    else:
        check_devices(cluster.accelerator, cluster.devices, cluster.num_nodes)
    _check_strategy_can_do(par)
    dims = build_parallel_dims(cfg)
    per_rank_batch = check_model_and_data(cfg, dims)
    resolve_micro_batch(cfg, dims, per_rank_batch)
    every = cfg.trainer.comm_timing_every_n_steps
    if every is not None and every < 1:
        raise ValueError(
            f"trainer.comm_timing_every_n_steps={every} must be >= 1, or null (every step on CUDA, "
            "once per logging window on CPU)."
        )
    _check_layout(cfg, dims, per_rank_batch)
    if cfg.trainer.enable_progress_bar is None:
        # Lightning's (rich) bar for a person at a terminal; none in files and CI logs, where it is noise.
        cfg.trainer.enable_progress_bar = sys.stdout.isatty()
    return dims


def _check_layout(cfg: TrainConfig, dims: ParallelDims, per_rank_batch: int | None) -> None:
    """The layout against the model and the batch: tensor-parallel sizes, pipeline stages and microbatches.

    A user's own module is checked by the strategy when it is set up (its hooks name what is wrong).
    """
    from lightning_dist.builders import num_blocks
    from lightning_dist.models.gpt import GPTConfig
    from lightning_dist.models.gpt_parallel import check_tensor_parallel
    from lightning_dist.parallel import pipeline
    from lightning_dist.parallel.activation_checkpoint import check_mode
    from lightning_dist.parallel.compose import compile_with_tp_error

    par = cfg.parallelism
    try:
        check_mode(par.activation_checkpointing, par.ac_selective)
    except ValueError as err:
        raise ValueError(f"parallelism.{err}") from None
    if par.compile and dims.tp_enabled:
        raise ValueError(compile_with_tp_error(dims.tp, "parallelism."))
    per_block = {
        "activation_checkpointing": par.activation_checkpointing != "none",
        "compile": par.compile,
        "cpu_offload": par.cpu_offload,
    }
    for name in [name for name, used in per_block.items() if used and par.strategy == "ddp"]:
        value = getattr(par, name)
        shown = str(value).lower() if isinstance(value, bool) else value
        raise ValueError(
            f"parallelism.{name}={shown} with parallelism=ddp (Lightning's DDP, which this does not reach): use "
            "parallelism=fsdp or another of our layouts."
        )
    if par.cpu_offload and not dims.dp_enabled:
        raise ValueError(
            f"parallelism.cpu_offload=true needs FSDP2 shards to offload but the layout is {dims.describe()}; set "
            "parallelism.dp_shard > 1 (e.g. parallelism=fsdp) or parallelism.cpu_offload=false."
        )
    gpt = isinstance(cfg.model, GPTConfig)
    if gpt:
        seq_len = getattr(cfg.data, "seq_len", None)
        check_tensor_parallel(cfg.model, dims.tp, seq_len, par.sequence_parallel)
    schedule = pipeline.resolve_schedule(par.schedule, par.stages_per_rank)
    if not dims.pp_enabled:
        return
    num_stages = dims.pp * par.stages_per_rank
    blocks = num_blocks(cfg.model)
    if blocks is not None and num_stages > blocks:
        raise ValueError(
            f"parallelism.pp={dims.pp} x stages_per_rank={par.stages_per_rank} = {num_stages} stages but the model "
            f"has {blocks} blocks; lower pp / stages_per_rank or use a model with more blocks."
        )
    if gpt and cfg.model.tie_embeddings and dims.tp_enabled:
        raise ValueError(
            f"model.tie_embeddings=true with parallelism.pp={dims.pp} and parallelism.tp={dims.tp}: a weight tied "
            "across pipeline stages is not supported with tensor parallelism yet; untie it or use pp or tp alone."
        )
    microbatches = par.microbatches if par.microbatches is not None else num_stages
    try:
        pipeline.check_microbatches(schedule, microbatches, dims.pp, par.stages_per_rank, batch_size=per_rank_batch)
    except ValueError as err:
        raise ValueError(f"parallelism.{err}") from None  # the same message, named as the config field


def _check_strategy_can_do(par) -> None:
    """Degrees the chosen strategy cannot do, named before any degree arithmetic muddles the message."""
    cannot = _CANNOT_DO[par.strategy]
    bad = [axis for axis in cannot if getattr(par, axis) > 1]
    if bad:
        values = " ".join(f"parallelism.{axis}={getattr(par, axis)}" for axis in bad)
        raise ValueError(
            f"{values} is not possible with parallelism.strategy={par.strategy} (it does {_DOES[par.strategy]}); "
            f"{cannot[bad[0]]}."
        )


# ------------------------------------------------------------------------------------------------------- one rank
def fit(cfg: TrainConfig, callbacks: tuple = (), dims: ParallelDims | None = None) -> dict[str, Any]:
    """Train on this rank with Lightning's ``Trainer.fit``; returns a summary (rank 0's is printed).

    Args:
        cfg: The run's config.
        callbacks: Extra Lightning callbacks.
        dims: The layout :func:`check_config` returned for ``cfg``; ``None`` = check ``cfg`` here (a rank started
            without the app's launcher, e.g. by a test).
    """
    import lightning.pytorch as pl

    from lightning_dist.builders import build_datamodule, build_module
    from lightning_dist.checkpoint import InitWeights, RunCheckpoints
    from lightning_dist.cluster import SharedFolderCheck, lightning_environment
    from lightning_dist.data import TokenDataModule
    from lightning_dist.heartbeat import Heartbeat
    from lightning_dist.loggers import build_logger, finish_wandb
    from lightning_dist.preemption import Preemption
    from lightning_dist.telemetry import LossHistory, Telemetry
    from lightning_dist.telemetry.history import merge_telemetry

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is not using a DistributedSampler.*")
    # Our data module resumes mid-epoch by optimizer step (StepSampler); Lightning cannot tell and warns.
    warnings.filterwarnings("ignore", ".*your dataloader is not resumable.*")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.output_dir)
    if dims is None:
        dims = check_config(cfg)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg)
    continuing = cfg.ckpt_path is not None and Path(cfg.ckpt_path).parent == out_dir / "checkpoints"
    logger = build_logger(cfg.logger, out_dir, cfg, continue_from=Path(cfg.ckpt_path) if continuing else None)
    history = LossHistory()
    every = cfg.checkpoint
    checkpoint = RunCheckpoints(out_dir / "checkpoints", every.every_n_steps, every.every_n_minutes, every.keep_last)
    preemption = Preemption()
    all_callbacks = [history, preemption, Heartbeat(cfg.trainer.hang_timeout_s), *callbacks]
    if cfg.trainer.telemetry:
        telemetry = Telemetry(
            peak_tflops=cfg.cluster.peak_tflops,
            track_comm=cfg.trainer.track_comm,
            comm_timing_every_n_steps=cfg.trainer.comm_timing_every_n_steps,
        )
        all_callbacks.append(telemetry)
    if cfg.trainer.enable_checkpointing:
        all_callbacks.append(checkpoint)
    if cfg.init_from is not None and cfg.ckpt_path is None:  # a checkpoint, when continuing, holds newer weights
        all_callbacks.append(InitWeights(Path(cfg.init_from)))
    if cfg.cluster.num_nodes > 1:
        all_callbacks.append(SharedFolderCheck(out_dir))
    trainer = pl.Trainer(
        plugins=lightning_environment(),
        accelerator=cfg.cluster.accelerator,
        devices=cfg.cluster.devices,
        num_nodes=cfg.cluster.num_nodes,
        strategy=build_strategy(cfg, dims),
        precision=cfg.cluster.precision,
        max_steps=cfg.trainer.max_steps,
        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches,
        val_check_interval=cfg.trainer.val_check_interval,
        check_val_every_n_epoch=None,  # val_check_interval counts steps across epochs
        limit_val_batches=cfg.trainer.limit_val_batches,
        num_sanity_val_steps=cfg.trainer.num_sanity_val_steps,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        enable_checkpointing=False,  # ours: RunCheckpoints (Lightning would add its ModelCheckpoint)
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        logger=logger,
        callbacks=all_callbacks,
        # Our data module samples by data-parallel rank itself; a user's loaders are dealt out by our strategies.
        use_distributed_sampler=not isinstance(datamodule, TokenDataModule),
        default_root_dir=out_dir,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if cfg.trainer.telemetry:
        merge_telemetry(history.records, telemetry.history)
    metrics = trainer.callback_metrics
    result = {
        "output_dir": str(out_dir),
        "layout": f"{cfg.parallelism.strategy}: {dims.describe()}",
        "steps": trainer.global_step,
        "train_loss": float(metrics["train/loss"]) if "train/loss" in metrics else float("nan"),
        "val_loss": float(metrics["val/loss"]) if "val/loss" in metrics else None,
        "loss_floor": getattr(datamodule, "loss_floor", None),
        "history": history.records,
        "checkpoint": str(checkpoint.last_path) if checkpoint.last_path else None,
        "checkpoint_blocked_s": checkpoint.blocked_s,
        "checkpoint_written_s": checkpoint.written_s,
        "preempted": preemption.signal_name,
        "wandb_dir": finish_wandb(logger),
        "csv": str(Path(logger.log_dir) / "metrics.csv") if cfg.logger.kind == "csv" else None,
    }
    return result


def build_strategy(cfg: TrainConfig, dims: ParallelDims):
    """The Lightning strategy: Lightning's DDPStrategy (loader order kept) for ``ddp``, else our mesh strategy.

    ``fsdp`` is FSDP2 (torch ``fully_shard``) through the mesh strategy with ``tp=1``: Lightning's FSDPStrategy
    wraps the older FSDP1 and refuses to run on CPU.
    """
    from datetime import timedelta

    from lightning_dist.strategies import DataParallelStrategy, MeshStrategy

    backend = cfg.cluster.process_group_backend
    timeout = timedelta(minutes=10)
    if cfg.parallelism.strategy == "ddp":
        return DataParallelStrategy(
            process_group_backend=backend, timeout=timeout, on_nonfinite=cfg.trainer.on_nonfinite
        )
    par = cfg.parallelism
    return MeshStrategy(
        parallel_dims=dims,
        sequence_parallel=par.sequence_parallel,
        loss_parallel=par.loss_parallel,
        schedule=par.schedule,
        microbatches=par.microbatches,
        stages_per_rank=par.stages_per_rank,
        split_points=par.split_points,
        activation_checkpointing=par.activation_checkpointing,
        ac_selective=par.ac_selective,
        compile=par.compile,
        cpu_offload=par.cpu_offload,
        on_nonfinite=cfg.trainer.on_nonfinite,
        async_save=cfg.checkpoint.async_save,
        process_group_backend=backend,
        timeout=timeout,
    )
