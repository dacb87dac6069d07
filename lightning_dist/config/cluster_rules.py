"""The cluster config checked against where this process runs (before launch): the accelerator, the devices this
machine can run, a SLURM submission's shape, the launcher's sizes, and a new run's folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lightning_dist import environment
from lightning_dist.checkpoint.folder import complete_checkpoints
from lightning_dist.environment import is_global_zero, launcher, launcher_sizes

#: What a run leaves in its folder that a new run there would replace: the report (``report.json``, written at every
#: run's end) and Lightning's CSV logger's rows (its writer deletes ``metrics.csv`` as it opens).
RUN_RESULTS = ("report.json", "csv/metrics.csv")


def check_new_run_folder(output_dir: str | None, ckpt_path: str | None = None) -> None:
    """A run that does not continue another (no ``resume``, not a torchrun / SLURM restart) starts in a folder that
    holds no run's checkpoints (it would overwrite them, and its ``metrics.csv`` rows would mix with theirs), nor, for
    a run without checkpoints, its results (:data:`RUN_RESULTS`: a new run would replace its report and metrics).

    ``ckpt_path`` naming a checkpoint of that folder continues its run, as ``resume`` does.

    Raises:
        ValueError: One line naming the folder, its newest checkpoint (or the results) and the fixes.
    """
    if output_dir is None:
        return
    checkpoints = Path(output_dir) / "checkpoints"
    found = complete_checkpoints(checkpoints)
    if ckpt_path is not None and Path(ckpt_path).resolve().parent == checkpoints.resolve():
        return
    if not found:
        results = [name for name in RUN_RESULTS if (Path(output_dir) / name).is_file()]
        if results:
            raise ValueError(
                f"output_dir={output_dir} already holds another run's results ({', '.join(results)}) and no checkpoint "
                "to continue it from; a new run there would replace them: start it in a new folder (output_dir=...), "
                "or move them away first."
            )
        return
    new_folder = "another --rdzv-id, or output_dir=..." if launcher() == "torchrun" else "output_dir=..."
    raise ValueError(
        f"output_dir={output_dir} already holds a run's checkpoints (newest {found[-1].name}); continue it with "
        f"resume={'auto' if launcher() in ('torchrun', 'slurm') else output_dir}, or start a new run in a new folder "
        f"({new_folder})."
    )


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` is ``gpu`` where CUDA devices are visible, else ``cpu``; other names are kept."""
    if accelerator == "auto":
        return "gpu" if environment.cuda_count() > 0 else "cpu"
    return accelerator


def check_submission(cluster: Any) -> None:
    """A SLURM job's shape and options, on the login node before submitting."""
    s = cluster.slurm
    if cluster.devices < 1 or cluster.num_nodes < 1:
        raise ValueError(f"cluster.devices={cluster.devices} and cluster.num_nodes={cluster.num_nodes} must be >= 1.")
    if s.time_min < 1:
        raise ValueError(f"cluster.slurm.time_min={s.time_min} must be >= 1 (minutes).")
    if not 0 <= s.signal_delay_s < 60 * s.time_min:
        raise ValueError(
            f"cluster.slurm.signal_delay_s={s.signal_delay_s} must be >= 0 and less than the time limit "
            f"({60 * s.time_min} s): it is how long before the limit the job is told to save."
        )
    if s.executor == "local" and (cluster.num_nodes > 1 or cluster.accelerator != "cpu"):
        raise ValueError(
            f"cluster.slurm.executor=local runs on this machine: it needs cluster.num_nodes=1 (got "
            f"{cluster.num_nodes}) and cluster.accelerator=cpu (got {cluster.accelerator})."
        )


def check_devices(accelerator: str, devices: int, num_nodes: int) -> None:
    """This machine can run ``devices`` local ranks of ``accelerator`` (a multi-node job: one start per node)."""
    if devices < 1:
        raise ValueError(f"cluster.devices={devices} must be >= 1.")
    if num_nodes > 1 and launcher() is None:
        raise ValueError(
            f"cluster.num_nodes={num_nodes}: a multi-node job is started once per node by torchrun or SLURM "
            "(e.g. torchrun --nnodes=N --nproc-per-node=8 -m lightning_dist.run.train ...); run it that way."
        )
    if accelerator in ("gpu", "cuda"):
        available = environment.cuda_count()
        if available == 0:
            raise ValueError(
                f"cluster.accelerator={accelerator} but no CUDA device is visible; "
                "use cluster=local_cpu on this machine."
            )
        if devices > available:
            raise ValueError(
                f"cluster.devices={devices} but only {available} CUDA device(s) are visible; "
                f"use cluster.devices<={available}."
            )
    elif accelerator == "cpu":
        # CPU ranks can share cores (tests run 4 gloo ranks on 2 cores); beyond 2 per core they only thrash.
        cores = os.cpu_count() or 1
        limit = max(4, 2 * cores)
        if devices > limit:
            raise ValueError(
                f"cluster.devices={devices} CPU processes is too many for {cores} cores; use cluster.devices<={limit}."
            )
    else:
        raise ValueError(f"cluster.accelerator={accelerator!r} is unknown; use cpu, gpu or auto.")


def should_submit(cluster: Any) -> bool:
    """``cluster.launcher=slurm`` on a login node (``cluster``: the run's ``ClusterConfig``): not already a rank,
    nor inside a submitit job."""
    return cluster.launcher == "slurm" and launcher() is None and "SUBMITIT_EXECUTOR" not in os.environ


def adopt_launcher_sizes(cluster: Any) -> None:
    """Under torchrun / ``srun`` the processes per node and the nodes are the launcher's: taken, not asked again."""
    stated = launcher_sizes()
    if stated is None or stated == (cluster.devices, cluster.num_nodes):
        return
    if is_global_zero():
        print(
            f"cluster.devices={stated[0]} cluster.num_nodes={stated[1]}: as {launcher()} started the job "
            f"(the config said {cluster.devices} x {cluster.num_nodes})",
            file=sys.stderr,
            flush=True,
        )
    cluster.devices, cluster.num_nodes = stated
