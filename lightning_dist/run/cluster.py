"""Checks a rank makes once it runs under torchrun or ``srun`` (its launcher's layout against the config), and
Lightning's cluster environment for it. What can be read before launch lives in
:mod:`lightning_dist.environment`.

Lightning is imported by the two functions that hand it objects, which run in a rank: the launcher imports this module
(for :func:`preflight`) without importing Lightning."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from lightning_dist.environment import env_int, launcher, slurm_tasks_on_node


# ---------------------------------------------------------------------------------------------------- preflight
def preflight(cfg: Any, dims: Any, env: Mapping[str, str] | None = None) -> None:
    """What one rank of a torchrun / SLURM job can check alone before the rendezvous; one line naming the value
    and the fix instead of a hang or a traceback.

    Raises:
        ValueError: Processes on this node, world size, tensor-parallel placement, master address or port.
    """
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    kind, c = launcher(env), cfg.cluster
    local = env_int(env.get("LOCAL_WORLD_SIZE")) or slurm_tasks_on_node(env)
    flag = "--nproc-per-node" if kind == "torchrun" else "--ntasks-per-node"
    if local and local != c.devices:
        raise ValueError(
            f"{kind} started {local} processes on this node ({flag}={local}) but cluster.devices={c.devices}; set "
            f"cluster.devices={local}, or {flag}={c.devices}."
        )
    world = env_int(env.get("WORLD_SIZE")) or env_int(env.get("SLURM_NTASKS"))
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


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            raise ValueError(
                f"MASTER_PORT={port} is already in use on {socket.gethostname()} (another job on this node?); "
                "export another MASTER_PORT in the job script."
            ) from None


def enable_flight_recorder(out_dir: Path, accelerator: str, env: MutableMapping[str, str] | None = None) -> None:
    """On CUDA, have NCCL record each rank's recent collectives and write them to ``<out_dir>/flight_recorder/``
    when one times out (``cluster.collective_timeout_s``): which collective each rank was in, and which rank never
    arrived. Read with ``python -m torch.distributed.flight_recorder.fr_trace <folder> -j``. Variables already set
    win; gloo (CPU) has no flight recorder. Called in a rank before its process group is created.
    """
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    if accelerator != "gpu":
        return
    folder = out_dir / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # entries kept per rank
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))  # one file per rank: rank_<n>


def lightning_environment() -> list[Any]:
    """Lightning's cluster environment for how this rank was started, set explicitly (Trainer ``plugins``).

    Under SLURM, Lightning's own SIGUSR1 requeue is off: :mod:`lightning_dist.callbacks.preemption` saves at a step
    boundary and :func:`lightning_dist.run.slurm.requeue` requeues. In our own ranks, a SLURM variable left in the
    shell must not make Lightning read its ranks from SLURM; nor under torchrun started by srun (one agent per node),
    where Lightning would look at SLURM's variables first.
    """
    # deferred: runs in a rank, where Lightning is loaded; the launcher never needs it (test_layering: DEFERRED)
    from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

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
        import lightning.pytorch as pl  # deferred: built in a rank (test_layering: DEFERRED)

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
