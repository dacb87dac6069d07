"""Where this process runs, read from its environment alone (no process group, nothing heavy imported): the
launcher (ours, torchrun, SLURM's ``srun``), the run
folder that every rank, node and restart of one job shares, and whether this start is a restart.

Only a real launcher's variables count: torchrun sets ``TORCHELASTIC_RUN_ID`` with ``LOCAL_RANK`` and
``WORLD_SIZE``; ``srun`` sets ``SLURM_STEP_ID`` with ``SLURM_PROCID`` and ``SLURM_NTASKS``. A variable left over in a
shell (a stray ``SLURM_PROCID``, an ``sbatch`` script's own environment) does not make a process a rank.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_dist.checkpoint.folder import complete_checkpoints

#: Set in every rank our own launcher starts (:mod:`lightning_dist.run.launch`): the launcher's pid.
OURS_ENV = "LIGHTNING_DIST_LAUNCHER_PID"


def launcher(env: Mapping[str, str] = os.environ) -> str | None:
    """``"ours"``, ``"torchrun"``, ``"slurm"`` (one ``srun`` task of several), ``"submitit"`` (a task of submitit's
    local executor), or ``None`` (a plain process)."""
    if OURS_ENV in env:
        return "ours"
    if all(var in env for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env_int(env.get("SLURM_NTASKS")) > 1:
        return "slurm"
    if env.get("SUBMITIT_EXECUTOR") == "local" and "RANK" in env and env_int(env.get("WORLD_SIZE")) > 1:
        return "submitit"  # submitit's local executor, its variables exported (slurm.adopt_submitit_environment)
    return None


def launcher_sizes(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``(processes on this node, nodes)`` as torchrun or ``srun`` started this job; ``None`` under another launcher.

    The launcher states these already (``--nproc-per-node`` / ``--ntasks-per-node`` and the world size); the config
    takes them instead of asking for them a second time.
    """
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


def slurm_tasks_on_node(env: Mapping[str, str] = os.environ) -> int:
    """``SLURM_TASKS_PER_NODE`` for this node ("8(x2)" or "8,8"), 0 where SLURM did not start us."""
    if launcher(env) != "slurm":
        return 0
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [env_int(count)] * (env_int(repeat.rstrip(")")) or 1)
    node = env_int(env.get("SLURM_NODEID"))
    return counts[node] if node < len(counts) else 0


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times the external launcher restarted this job (torchrun ``--max-restarts``, a SLURM requeue)."""
    kind = launcher(env)
    if kind == "torchrun":
        return env_int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if kind == "slurm":
        return env_int(env.get("SLURM_RESTART_COUNT"))
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


# -------------------------------------------------------------------------------------------- before launch
def check_new_run_folder(output_dir: str | None, ckpt_path: str | None = None) -> None:
    """A run that does not continue another (no ``resume``, not a torchrun / SLURM restart) starts in a folder that
    holds no run's checkpoints: it would overwrite them, and its ``metrics.csv`` rows would mix with theirs.

    ``ckpt_path`` naming a checkpoint of that folder continues its run, as ``resume`` does.

    Raises:
        ValueError: One line naming the folder, its newest checkpoint and the fixes.
    """
    if output_dir is None:
        return
    checkpoints = Path(output_dir) / "checkpoints"
    found = complete_checkpoints(checkpoints)
    if not found or (ckpt_path is not None and Path(ckpt_path).resolve().parent == checkpoints.resolve()):
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
        return "gpu" if cuda_count() > 0 else "cpu"
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
        available = cuda_count()
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


def cuda_count() -> int:
    """CUDA devices torch sees; torch is imported here, for a config that asks (``gpu`` / ``auto``), not a CPU run's."""
    import torch  # deferred: the launcher checks a CPU config without torch (tests/unit/test_layering.py: DEFERRED)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def is_global_zero(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is rank 0 of its job (or not a rank at all), from the launcher's variables: ``RANK``
    (ours, torchrun, submitit) or ``SLURM_PROCID`` (``srun`` sets no ``RANK``). For one writer per job before (or
    without) a Lightning ``Trainer``; a Lightning callback uses ``trainer.is_global_zero``."""
    return env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"


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
