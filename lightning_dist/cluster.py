"""Who started this process, and what follows from it: the launcher (ours, torchrun, SLURM's ``srun``), the run
folder that every rank, node and restart of one job shares, and whether this start is a restart.

Only a real launcher's variables count: torchrun sets ``TORCHELASTIC_RUN_ID`` with ``LOCAL_RANK`` and
``WORLD_SIZE``; ``srun`` sets ``SLURM_STEP_ID`` with ``SLURM_PROCID`` and ``SLURM_NTASKS``. A variable left over in a
shell (a stray ``SLURM_PROCID``, an ``sbatch`` script's own environment) does not make a process a rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

#: Set in every rank our own launcher starts (:mod:`lightning_dist.launch`): the launcher's pid.
OURS_ENV = "LIGHTNING_DIST_LAUNCHER_PID"


def launcher(env: Mapping[str, str] = os.environ) -> str | None:
    """``"ours"``, ``"torchrun"``, ``"slurm"`` (one ``srun`` task of several), or ``None`` (a plain process)."""
    if OURS_ENV in env:
        return "ours"
    if all(var in env for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and _int(env.get("SLURM_NTASKS")) > 1:
        return "slurm"
    return None


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the external launcher restarted this job (torchrun ``--max-restarts``, a SLURM requeue)."""
    kind = launcher(env)
    if kind == "torchrun":
        return _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if kind == "slurm":
        return _int(env.get("SLURM_RESTART_COUNT"))
    return 0


def run_dir(root: str = "outputs", env: Mapping[str, str] = os.environ) -> str:
    """The run folder (Hydra's ``hydra.run.dir``): the same for every rank, node and restart of one job.

    - torchrun: ``<root>/torchrun-<rdzv id>``; with torchrun's default id ``none``, the start time of the torchrun
      agent (the ranks' parent), so all its ranks and restarts agree (one node: several need ``--rdzv-id``).
    - SLURM (``srun``): ``<root>/slurm-<job id>`` (``<array job>_<task>`` in an array), kept across requeues.
    - Otherwise: ``<root>/<date>/<time>``, now.
    """
    kind = launcher(env)
    if kind == "torchrun":
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id and run_id != "none":
            return f"{root}/torchrun-{run_id}"
        return f"{root}/{time.strftime('%Y-%m-%d/%H-%M-%S', time.localtime(_start_time(os.getppid())))}"
    if kind == "slurm":
        if "SLURM_ARRAY_JOB_ID" in env:
            return f"{root}/slurm-{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '0')}"
        return f"{root}/slurm-{env.get('SLURM_JOB_ID', 'unknown')}"
    return f"{root}/{time.strftime('%Y-%m-%d/%H-%M-%S')}"


def _start_time(pid: int) -> float:
    """When process ``pid`` started (epoch seconds), from ``/proc``; now where that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
