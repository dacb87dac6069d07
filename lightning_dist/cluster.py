"""Who started this process, and what follows from it: the launcher (ours, torchrun, SLURM's ``srun``), the run
folder that every rank, node and restart of one job shares, and whether this start is a restart.

Only a real launcher's variables count: torchrun sets ``TORCHELASTIC_RUN_ID`` with ``LOCAL_RANK`` and
``WORLD_SIZE``; ``srun`` sets ``SLURM_STEP_ID`` with ``SLURM_PROCID`` and ``SLURM_NTASKS``. A variable left over in a
shell (a stray ``SLURM_PROCID``, an ``sbatch`` script's own environment) does not make a process a rank.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Set in every rank our own launcher starts (:mod:`lightning_dist.launch`): the launcher's pid.
OURS_ENV = "LIGHTNING_DIST_LAUNCHER_PID"


def launcher(env: Mapping[str, str] = os.environ) -> str | None:
    """``"ours"``, ``"torchrun"``, ``"slurm"`` (one ``srun`` task of several), ``"submitit"`` (a task of submitit's
    local executor), or ``None`` (a plain process)."""
    if OURS_ENV in env:
        return "ours"
    if all(var in env for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and _int(env.get("SLURM_NTASKS")) > 1:
        return "slurm"
    if env.get("SUBMITIT_EXECUTOR") == "local" and "RANK" in env and _int(env.get("WORLD_SIZE")) > 1:
        return "submitit"  # submitit's local executor, its variables exported (slurm.adopt_submitit_environment)
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


# -------------------------------------------------------------------------------------------- before launch
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
            "(e.g. torchrun --nnodes=N --nproc-per-node=8 -m lightning_dist.train ...); run it that way."
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
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------------------------------------- preflight
def preflight(cfg: Any, dims: Any, env: Mapping[str, str] = os.environ) -> None:
    """What one rank of a torchrun / SLURM job can check alone before the rendezvous; one line naming the value
    and the fix instead of a hang or a traceback.

    Raises:
        ValueError: Processes on this node, world size, tensor-parallel placement, master address or port.
    """
    kind, c = launcher(env), cfg.cluster
    local = _int(env.get("LOCAL_WORLD_SIZE")) or _slurm_tasks_on_node(env)
    flag = "--nproc-per-node" if kind == "torchrun" else "--ntasks-per-node"
    if local and local != c.devices:
        raise ValueError(
            f"{kind} started {local} processes on this node ({flag}={local}) but cluster.devices={c.devices}; set "
            f"cluster.devices={local}, or {flag}={c.devices}."
        )
    world = _int(env.get("WORLD_SIZE")) or _int(env.get("SLURM_NTASKS"))
    if world and world != c.devices * c.num_nodes:
        nodes = world // c.devices if world % c.devices == 0 else None
        fix = f"set cluster.num_nodes={nodes}" if nodes else "make cluster.devices x cluster.num_nodes match it"
        raise ValueError(
            f"{kind} started {world} processes in all but cluster.devices={c.devices} x cluster.num_nodes="
            f"{c.num_nodes} = {c.devices * c.num_nodes}; {fix}."
        )
    check_tensor_parallel_placement(dims.tp, c.devices, c.num_nodes)
    address = env.get("MASTER_ADDR")
    if address:
        try:
            socket.getaddrinfo(address, None)
        except OSError as err:
            raise ValueError(
                f"MASTER_ADDR={address} does not resolve on {socket.gethostname()} ({err.strerror}); give the first "
                "node's hostname or IP address (torchrun --rdzv-endpoint / --master-addr)."
            ) from None
    if kind == "slurm" and env.get("SLURM_PROCID") == "0" and env.get("MASTER_PORT"):
        _check_port_free(int(env["MASTER_PORT"]))  # rank 0 will listen there (torchrun's agent holds its own)


def check_tensor_parallel_placement(tp: int, devices: int, num_nodes: int) -> None:
    """Tensor parallelism stays inside a node: the mesh puts ``tp`` innermost (consecutive ranks), so a tp group
    lies on one node when ``tp`` divides the devices per node. dp and pp span nodes; tp would put its per-layer
    all-reduces on the slowest links.

    Raises:
        ValueError: ``tp`` does not divide ``devices`` on a multi-node job.
    """
    if num_nodes > 1 and devices % tp:
        raise ValueError(
            f"parallelism.tp={tp} does not divide cluster.devices={devices} (per node): a tensor-parallel group would "
            f"span nodes; use a tp that divides {devices} and put the rest into dp_shard or pp."
        )


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int:
    """``SLURM_TASKS_PER_NODE`` for this node ("8(x2)" or "8,8"), 0 where SLURM did not start us."""
    if launcher(env) != "slurm":
        return 0
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [_int(count)] * (_int(repeat.rstrip(")")) or 1)
    node = _int(env.get("SLURM_NODEID"))
    return counts[node] if node < len(counts) else 0


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            raise ValueError(
                f"MASTER_PORT={port} is already in use on {socket.gethostname()} (another job on this node?); "
                "export another MASTER_PORT in the job script."
            ) from None


def lightning_environment() -> list[Any]:
    """Lightning's cluster environment for how this rank was started, set explicitly (Trainer ``plugins``).

    Under SLURM, Lightning's own SIGUSR1 requeue is off: :mod:`lightning_dist.preemption` saves at a step boundary
    and :func:`lightning_dist.slurm.requeue` requeues. In our own ranks, a SLURM variable left in the shell must
    not make Lightning read its ranks from SLURM; nor under torchrun started by srun (one agent per node), where
    Lightning would look at SLURM's variables first.
    """
    from lightning.pytorch.plugins.environments import (
        LightningEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    kind = launcher()
    if kind == "slurm":
        return [SLURMEnvironment(auto_requeue=False)]
    if kind == "torchrun":
        return [TorchElasticEnvironment()]
    if kind == "ours":
        return [LightningEnvironment()]
    return []


class SharedFolderCheck:
    """A Lightning callback running :func:`check_shared_folder` at setup (built lazily: no Lightning import here)."""

    def __new__(cls, folder: Path) -> Any:
        import lightning.pytorch as pl

        class _SharedFolderCheck(pl.Callback):
            def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
                check_shared_folder(folder, trainer.strategy)

        return _SharedFolderCheck()


def check_shared_folder(folder: Path, strategy: Any) -> None:
    """Every rank sees the file rank 0 wrote in the run folder: checkpoints and logs need one shared folder.

    Called on every rank once the process group is up (the check needs a broadcast and a barrier).

    Raises:
        ValueError: This rank does not see it (one line naming the host and the folder).
    """
    token = strategy.broadcast(f".shared-{os.getpid()}-{time.time_ns()}")
    marker = Path(folder) / token
    if strategy.global_rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname())
    strategy.barrier()
    seen = marker.exists()
    strategy.barrier()
    if strategy.global_rank == 0:
        marker.unlink()
    if not seen:
        raise ValueError(
            f"the run folder {folder} is not shared: rank {strategy.global_rank} on {socket.gethostname()} does not "
            "see the file rank 0 wrote there; set output_dir to a folder on a filesystem every node mounts."
        )
