"""SLURM: submit the training job with submitit (the library Hydra's submitit launcher uses), requeue it after a
preemption, and print what would be submitted.

``lightning-dist-train cluster=slurm cluster.num_nodes=2 ...`` on a login node submits one job of ``num_nodes`` x
``devices`` tasks (one per device: ``--ntasks-per-node`` = ``cluster.devices``, as Lightning's SLURM environment
requires). Each task runs :func:`lightning_dist.run.train.run` as one rank; all share the run folder decided here.

The job is sent ``SIGUSR2`` (submitit's ``--signal``) ``signal_delay_s`` before its time limit, and SIGTERM when
preempted: the ranks stop after the same step and save (:mod:`lightning_dist.callbacks.preemption`), rank 0 requeues
the job, and the requeued job (``SLURM_RESTART_COUNT`` > 0) continues from that checkpoint in the same folder, with
the same W&B run.

``-m`` sweeps with ``hydra/launcher=slurm`` (``conf/hydra/launcher/slurm.yaml``: Hydra's submitit launcher with
these fields) become job arrays; each array task's ranks share its sweep folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dist import _compat
from lightning_dist.config.schema import TrainConfig
from lightning_dist.environment import is_global_zero, launcher
from lightning_dist.run.result import RunResult


def submit(cfg: TrainConfig, layout: str, run: Callable[[TrainConfig], RunResult]) -> RunResult:
    """Submit ``cfg`` (or print it, with ``cluster.slurm.dry_run``); with the ``local`` executor, run it and wait.

    ``run`` is what each task calls with ``cfg`` (the app's :func:`lightning_dist.run.train.run`; passed in, so
    this module does not import the app that imports it).

    Returns:
        ``output_dir``, ``layout``, ``job_id`` (``None`` and ``dry_run`` for a dry run), and the rest of the run's
        summary (but its ``history``) when it ran here.
    """
    out_dir = Path(cfg.output_dir)
    executor = build_executor(cfg, out_dir / ".submitit")
    if cfg.cluster.slurm.dry_run:
        print(_compat.sbatch_script(executor))
        print(describe(cfg, layout))
        return RunResult(output_dir=str(out_dir), layout=layout, dry_run=True)
    job = executor.submit(Job(cfg, run))
    print(f"submitted job {job.job_id}: {describe(cfg, layout)}; logs in {out_dir / '.submitit'}", flush=True)
    if cfg.cluster.slurm.executor == "local":  # rank 0's summary, sent back as a plain dict
        return RunResult.from_dict({**job.results()[0], "output_dir": str(out_dir), "job_id": job.job_id})
    return RunResult(output_dir=str(out_dir), layout=layout, job_id=job.job_id)


def build_executor(cfg: TrainConfig, folder: Path) -> Any:
    """A submitit executor for ``cfg.cluster`` (``SlurmExecutor``, or ``LocalExecutor`` for ``executor=local``).

    Raises:
        ValueError: submitit is not installed, or ``executor`` is unknown.
    """
    try:
        import submitit
    except ImportError:
        raise ValueError("cluster.launcher=slurm needs submitit: pip install 'lightning-dist[slurm]'.") from None
    c, s = cfg.cluster, cfg.cluster.slurm
    if s.executor == "local":
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(timeout_min=s.time_min, nodes=c.num_nodes, tasks_per_node=c.devices)
        return executor
    if s.executor != "slurm":
        raise ValueError(f"cluster.slurm.executor={s.executor!r} is unknown; use slurm, or local (this machine).")
    executor = submitit.SlurmExecutor(folder) if not s.dry_run else _compat.slurm_executor_anywhere(folder)
    params: dict[str, Any] = {
        "job_name": "lightning-dist",
        "nodes": c.num_nodes,
        "ntasks_per_node": c.devices,
        "time": s.time_min,
        "signal_delay_s": s.signal_delay_s,
        "setup": list(s.setup),
        "additional_parameters": dict(s.additional),
    }
    optional = {
        "gpus_per_node": s.gpus_per_node,
        "cpus_per_task": s.cpus_per_task,
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "mem": f"{s.mem_gb}GB" if s.mem_gb else None,
    }
    params.update({key: value for key, value in optional.items() if value is not None})
    executor.update_parameters(**params)
    return executor


def describe(cfg: TrainConfig, layout: str) -> str:
    """The job's shape and which ranks each node holds, e.g. ``2 nodes x 8 tasks; node 0: ranks 0-7; ...``."""
    c = cfg.cluster
    nodes = "; ".join(f"node {n}: ranks {n * c.devices}-{(n + 1) * c.devices - 1}" for n in range(c.num_nodes))
    return f"{c.num_nodes} node(s) x {c.devices} tasks, {layout}; {nodes}; run folder {cfg.output_dir}"


class Job:
    """What each SLURM task runs: one rank of the training job (picklable: submitit sends it to the nodes)."""

    def __init__(self, cfg: TrainConfig, run: Callable[[TrainConfig], RunResult]) -> None:
        self.cfg, self.run = cfg, run

    def __call__(self) -> dict[str, Any]:
        """The task's summary as a plain dict (:meth:`RunResult.to_dict`), without the per-step ``history``."""
        adopt_submitit_environment()
        result = self.run(self.cfg)
        if result.preempted and self.cfg.cluster.slurm.requeue:
            requeue()
        return {k: v for k, v in result.to_dict().items() if k != "history"}


def adopt_submitit_environment() -> None:
    """In a task of a several-task submitit job, export torch's rank variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ...) from submitit's job environment: SLURM's own variables under SLURM, submitit's under its
    local executor. Nothing otherwise."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "RANK" in os.environ:
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        # The job's environment is authoritative: a MASTER_ADDR left in the submitting shell must not win.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def requeue() -> None:
    """Put this SLURM job (or array task) back in the queue; global rank 0 only, once the checkpoint is written."""
    if not is_global_zero() or launcher() != "slurm":
        return
    job = os.environ.get("SLURM_JOB_ID", "")
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    line = f"requeued SLURM job {job}" if done.returncode == 0 else f"scontrol requeue {job} failed: {done.stderr}"
    print(line.strip(), file=sys.stderr, flush=True)
