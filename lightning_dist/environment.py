"""Where this process runs, read from its environment alone (no process group, nothing heavy imported): the
launcher (ours, torchrun, SLURM's ``srun``), the run
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

#: Set in every rank our own launcher starts (:mod:`lightning_dist.run.launch`): the launcher's pid.
OURS_ENV = "LIGHTNING_DIST_LAUNCHER_PID"


def launcher(env: Mapping[str, str] | None = None) -> str | None:
    """``"ours"``, ``"torchrun"``, ``"slurm"`` (one ``srun`` task of several), ``"submitit"`` (a task of submitit's
    local executor), or ``None`` (a plain process)."""
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    if OURS_ENV in env:
        return "ours"
    if all(var in env for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env_int(env.get("SLURM_NTASKS")) > 1:
        return "slurm"
    if env.get("SUBMITIT_EXECUTOR") == "local" and "RANK" in env and env_int(env.get("WORLD_SIZE")) > 1:
        return "submitit"  # submitit's local executor, its variables exported (slurm.adopt_submitit_environment)
    return None


def launcher_sizes(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(processes on this node, nodes)`` as torchrun or ``srun`` started this job; ``None`` under another launcher.

    The launcher states these already (``--nproc-per-node`` / ``--ntasks-per-node`` and the world size); the config
    takes them instead of asking for them a second time.
    """
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    kind = launcher(env)
    if kind == "torchrun":
        local, world = env_int(env.get("LOCAL_WORLD_SIZE")), env_int(env.get("WORLD_SIZE"))
    elif kind == "slurm":
        local, world = slurm_tasks_on_node(env), env_int(env.get("SLURM_NTASKS"))
    else:
        return None
    if not local or not world or world % local:
        return None  # uneven nodes: left to the preflight check, which names the numbers
    return local, world // local


def slurm_tasks_on_node(env: Mapping[str, str] | None = None) -> int:
    """``SLURM_TASKS_PER_NODE`` for this node ("8(x2)" or "8,8"), 0 where SLURM did not start us."""
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    if launcher(env) != "slurm":
        return 0
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [env_int(count)] * (env_int(repeat.rstrip(")")) or 1)
    node = env_int(env.get("SLURM_NODEID"))
    return counts[node] if node < len(counts) else 0


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times the external launcher restarted this job (torchrun ``--max-restarts``, a SLURM requeue)."""
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    kind = launcher(env)
    if kind == "torchrun":
        return env_int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if kind == "slurm":
        return env_int(env.get("SLURM_RESTART_COUNT"))
    return 0


def run_dir(root: str = "outputs", env: Mapping[str, str] | None = None) -> str:
    """The run folder (Hydra's ``hydra.run.dir``): the same for every rank, node and restart of one job.

    - torchrun: ``<root>/torchrun-<rdzv id>``; with torchrun's default id ``none``, the start time of the torchrun
      agent (the ranks' parent), so all its ranks and restarts agree (one node: several need ``--rdzv-id``).
    - SLURM (``srun``): ``<root>/slurm-<job id>`` (``<array job>_<task>`` in an array), kept across requeues.
    - Otherwise: ``<root>/<date>/<time>``, now.
    """
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    kind = launcher(env)
    if kind == "torchrun":
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id and run_id != "none":
            return f"{root}/torchrun-{run_id}"
        return f"{root}/{time.strftime('%Y-%m-%d/%H-%M-%S', time.localtime(process_start_time(os.getppid())))}"
    if kind == "slurm":
        if "SLURM_ARRAY_JOB_ID" in env:
            return f"{root}/slurm-{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '0')}"
        return f"{root}/slurm-{env.get('SLURM_JOB_ID', 'unknown')}"
    return f"{root}/{time.strftime('%Y-%m-%d/%H-%M-%S')}"


def hydra_run_dir(root: str, output_dir: str | None = None, resume: str | None = None) -> str:
    """Hydra's ``hydra.run.dir``: ``output_dir`` when given, the folder of the run ``resume`` names, else
    :func:`run_dir` (a new folder under ``root``). Hydra writes its own files there (``.hydra/``, its log), so a run
    leaves nothing in a folder of its own choosing, and a resumed run's errors are in the run it continues."""
    if output_dir:
        return str(output_dir)
    if resume and resume != "auto":
        return str(resume_folder(resume))
    return run_dir(root)


def hydra_subdir(folder: str) -> str | None:
    """Hydra's ``hydra.output_subdir`` in the run folder ``folder``: ``.hydra`` for a run's first start, one folder
    below it per later start (a resume keeps the config the run started with); none on ranks other than 0 (under
    torchrun / srun every rank composes the config)."""
    if not is_global_zero():
        return None
    if (Path(folder) / ".hydra" / "config.yaml").is_file():
        return f".hydra/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    return ".hydra"


def resume_folder(resume: str) -> Path:
    """The run folder ``resume=<path>`` names: the path itself, or the run of the ``checkpoints`` folder or the
    checkpoint it names."""
    path = Path(resume).expanduser().resolve()
    folder = path.parent.parent if path.parent.name == "checkpoints" else path
    return folder.parent if folder.name == "checkpoints" else folder


def process_start_time(pid: int) -> float:
    """When process ``pid`` started (epoch seconds), from ``/proc``; now where that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def env_int(value: str | None) -> int:
    """An integer environment variable's value; 0 when unset or not a number."""
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def cuda_count() -> int:
    """CUDA devices torch sees; torch is imported here, for a config that asks (``gpu`` / ``auto``), not a CPU run's."""
    import torch  # deferred: the launcher checks a CPU config without torch (tests/unit/test_layering.py: DEFERRED)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def is_global_zero(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is rank 0 of its job (or not a rank at all), from the launcher's variables: ``RANK``
    (ours, torchrun, submitit) or ``SLURM_PROCID`` (``srun`` sets no ``RANK``). For one writer per job before (or
    without) a Lightning ``Trainer``; a Lightning callback uses ``trainer.is_global_zero``."""
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    return env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"
