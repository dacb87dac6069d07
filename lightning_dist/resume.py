"""Which run this is and where it starts: its length and checkpoint options, the run it continues (``resume``,
``ckpt_path``, a torchrun / SLURM restart) or the weights it starts from (``init_from``), checked before launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning_dist.checkpoint import latest_checkpoint
from lightning_dist.config import TrainConfig


def check_run(cfg: TrainConfig) -> None:
    """The run's length and checkpoints, and which run it continues (``resume`` / ``ckpt_path=last``) or starts
    from (``init_from``); resolves ``resume`` into ``output_dir`` and ``ckpt_path``.

    Raises:
        ValueError: One line naming the value and the fix.
    """
    from lightning_dist.checkpoint import check_loadable
    from lightning_dist.strategies.guard import check_action

    trainer, every = cfg.trainer, cfg.checkpoint
    try:
        check_action(trainer.on_nonfinite)
    except ValueError as err:
        raise ValueError(f"trainer.{err}") from None
    for name in ("max_steps", "val_check_interval", "log_every_n_steps"):
        if getattr(trainer, name) < 1:
            raise ValueError(f"trainer.{name}={getattr(trainer, name)} must be >= 1.")
    if every.every_n_steps is not None and every.every_n_steps < 1:
        raise ValueError(f"checkpoint.every_n_steps={every.every_n_steps} must be >= 1, or null (not by steps).")
    if every.every_n_minutes is not None and every.every_n_minutes <= 0:
        raise ValueError(f"checkpoint.every_n_minutes={every.every_n_minutes} must be > 0, or null (not by time).")
    if trainer.hang_timeout_s is not None and trainer.hang_timeout_s <= 0:
        raise ValueError(f"trainer.hang_timeout_s={trainer.hang_timeout_s} must be > 0, or null (automatic).")
    if trainer.max_restarts < 0:
        raise ValueError(f"trainer.max_restarts={trainer.max_restarts} must be >= 0.")
    if every.async_save and cfg.parallelism.strategy == "ddp":
        raise ValueError(
            "checkpoint.async_save=true needs a mesh layout (sharded checkpoints); parallelism=ddp saves one file: "
            "use parallelism=fsdp, or checkpoint.async_save=false."
        )
    if every.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={every.keep_last} must be >= 1 (the newest checkpoint is always kept).")
    if cfg.ckpt_path == "last":
        cfg.resume, cfg.ckpt_path = "auto", None
    _continue_after_external_restart(cfg)
    if cfg.resume is not None:
        if cfg.ckpt_path is not None:
            raise ValueError(f"resume={cfg.resume} and ckpt_path={cfg.ckpt_path}: set only one of them.")
        run_dir, found = resolve_resume(cfg.resume, cfg.output_dir)
        cfg.output_dir, cfg.ckpt_path, cfg.resume = str(run_dir), str(found), None
    elif cfg.ckpt_path is not None and not Path(cfg.ckpt_path).exists():
        raise ValueError(f"ckpt_path={cfg.ckpt_path} does not exist; give a checkpoint file or folder.")
    if cfg.ckpt_path is not None:
        check_loadable(Path(cfg.ckpt_path))
    elif cfg.init_from is not None:
        _check_init_from(cfg)


def _continue_after_external_restart(cfg: TrainConfig) -> None:
    """torchrun ``--max-restarts`` or a SLURM requeue started this job again: continue from its newest checkpoint.

    The first start of a torchrun / srun job whose folder (named by the rendezvous id or job id) already holds
    checkpoints is refused: continuing or overwriting another run must be asked for.
    """
    from lightning_dist.cluster import launcher, restart_count

    if launcher() not in ("torchrun", "slurm") or cfg.resume is not None or cfg.ckpt_path is not None:
        return
    found = latest_checkpoint(Path(cfg.output_dir) / "checkpoints") if cfg.output_dir else None
    restarts = restart_count()
    if found is not None and restarts == 0:
        raise ValueError(
            f"output_dir={cfg.output_dir} already holds a run's checkpoints (newest {found.name}); continue it with "
            "resume=auto, or start a new run in a new folder (another --rdzv-id, or output_dir=...)."
        )
    if found is not None:
        cfg.ckpt_path = str(found)
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(f"restart {restarts}: continuing from {found}", file=sys.stderr, flush=True)


def _check_init_from(cfg: TrainConfig) -> None:
    """``init_from`` names weights this model can start from: a HuggingFace folder or a whole checkpoint folder."""
    from lightning_dist.checkpoint import check_loadable
    from lightning_dist.config import HFModelConfig
    from lightning_dist.export import is_hf_folder
    from lightning_dist.models.gpt import GPTConfig
    from lightning_dist.models.gpt_hf import from_hf_names

    path = Path(cfg.init_from)
    if is_hf_folder(path):
        if isinstance(cfg.model, GPTConfig):
            from_hf_names(cfg.model)  # raises for the layouts that cannot be read slice by slice
        elif not isinstance(cfg.model, HFModelConfig):
            raise ValueError(
                f"init_from={path} is a HuggingFace folder, which only the built-in GPT and model=hf read; start from "
                "a lightning-dist checkpoint folder, or load the weights in your module's configure_model."
            )
    elif path.is_dir() and (path / ".metadata").exists():
        check_loadable(path)
    else:
        raise ValueError(
            f"init_from={path} is neither a HuggingFace folder (config.json + *.safetensors) nor a sharded checkpoint "
            "folder (.metadata); export a checkpoint with lightning-dist-export, or give its checkpoints/step-N folder."
        )
    if isinstance(cfg.model, (GPTConfig, HFModelConfig)):  # names and shapes, on the meta device: nothing allocated
        import torch

        from lightning_dist.builders import build_module
        from lightning_dist.checkpoint import weight_sources

        with torch.device("meta"):
            module = build_module(cfg)
            module.configure_model()
        weight_sources(path, module, module.state_dict())


def resolve_resume(resume: str, output_dir: str | None) -> tuple[Path, Path]:
    """The run folder to continue and its newest complete checkpoint, for ``resume=auto`` or ``resume=<path>``.

    ``auto`` continues ``output_dir``; a path names a run folder, its ``checkpoints`` folder, or one checkpoint in it.

    Raises:
        ValueError: There is no complete checkpoint to continue from (one line naming where it looked).
    """
    if resume == "auto":
        if output_dir is None:
            raise ValueError("resume=auto continues output_dir, which is not set; pass resume=<run folder>.")
        run_dir = Path(output_dir)
    else:
        path = Path(resume).expanduser().resolve()
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
        run_dir = run_dir.parent if run_dir.name == "checkpoints" else run_dir
        if path.parent.name == "checkpoints" and path.exists():
            return run_dir, path
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        raise ValueError(
            f"resume={resume}: no complete checkpoint in {run_dir / 'checkpoints'}; give the folder of the run to "
            "continue (resume=outputs/<date>/<time>), or start a new run without resume."
        )
    return run_dir, found
