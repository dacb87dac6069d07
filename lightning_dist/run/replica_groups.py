"""Fault-tolerant replica groups started by the app (``parallelism.replicas.recovery=torchft``): one torchft
Lighthouse, each of the ``dp_replicate`` groups a job of its own, and a group that fails restarted alone.

Each group runs ``cluster.devices / dp_replicate`` ranks (:func:`lightning_dist.run.launch.launch`, its own process
group and run folder ``<run>/replica-<r>``); the others train on while it is away (the Lighthouse drops it after
``parallelism.replicas.heartbeat_timeout_s``), and its replacement starts from ``ckpt_path=FROM_PEER``: a healthy
group's live state, copied by torchft (:mod:`lightning_dist.strategies.replica_state`), not a checkpoint file. A
failure that would repeat (a non-finite step, too few groups left for a quorum) is not restarted. The job's result
is the first group's that finished. Under torchrun / srun each group is its own job and the Lighthouse yours:
docs/how-to/failures.md.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_dist.config.validate import ValidRun
from lightning_dist.run.console import say
from lightning_dist.run.launch import RankFailedError, free_port, launch
from lightning_dist.run.result import RunResult

#: The ``ckpt_path`` a replaced group starts from (:data:`lightning_dist.parallel.replicas.FROM_PEER`; the launcher
#: does not import torch).
FROM_PEER = "torchft:peer"
#: Set in every rank of a replica group the app started: the group's index.
GROUP_ENV = "LIGHTNING_DIST_REPLICA_GROUP"


def launch_replica_groups(
    valid: ValidRun, fit: Callable[[ValidRun], RunResult], report: Callable[[ValidRun, RunResult], None]
) -> RunResult:
    """Run ``fit`` in every replica group of ``valid`` at once, each group restarted alone when it fails, and
    ``report`` each group's result into its own folder as it finishes.

    Raises:
        RankFailedError: No group finished (the first group's last failure).
    """
    cfg, dims = valid.cfg, valid.dims
    options = cfg.parallelism.replicas
    lighthouse = None
    address = options.lighthouse
    if address is None:
        lighthouse, address = start_lighthouse(options.min_replicas, options.heartbeat_timeout_s)
    results: dict[int, RunResult] = {}
    failures: dict[int, RankFailedError] = {}
    try:
        threads = [
            threading.Thread(
                target=_run_group,
                args=(valid, group, address, fit, report, results, failures),
                name=f"replica-group-{group}",
                daemon=True,
            )
            for group in range(dims.dp_replicate)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait(10)
    if not results:
        raise failures[min(failures)]
    return results[min(results)]


def _run_group(
    valid: ValidRun,
    group: int,
    address: str,
    fit: Callable[[ValidRun], RunResult],
    report: Callable[[ValidRun, RunResult], None],
    results: dict[int, RunResult],
    failures: dict[int, RankFailedError],
) -> None:
    """One replica group's job, started again from a healthy peer each time it fails (``resilience.max_restarts``)."""
    cfg = valid.cfg
    groups = valid.dims.dp_replicate
    replicas = replace(cfg.parallelism.replicas, group=group, lighthouse=address)
    folder = Path(cfg.output_dir) / f"replica-{group}"
    group_cfg = replace(
        cfg,
        output_dir=str(folder),
        parallelism=replace(cfg.parallelism, replicas=replicas),
        cluster=replace(cfg.cluster, devices=cfg.cluster.devices // groups),
    )
    restarts = cfg.resilience.max_restarts
    start = time.perf_counter()
    for attempt in range(restarts + 1):
        try:
            env = {GROUP_ENV: str(group)}  # in each rank's environment: which group a process belongs to
            ranks = group_cfg.cluster.devices
            name = f"group{group}-rank"  # as ps shows them: group1-rank0
            group_valid = replace(valid, cfg=group_cfg)
            result = launch(fit, ranks, group_valid, env=env, name=name)[0]
            result.wall_time_s = time.perf_counter() - start
            report(group_valid, result)
            results[group] = result
            return
        except RankFailedError as err:
            failures[group] = err
            if attempt == restarts or err.will_repeat:
                say(f"replica group {group}: {err}; not restarted (the other groups train on without it)", err=True)
                return
            line = (
                f"replica group {group} left at {time.strftime('%H:%M:%S')}: {err}; the other groups train on, and "
                f"it restarts ({attempt + 1}/{restarts}) from a healthy group's state"
            )
            say(line, err=True)
            with (Path(cfg.output_dir) / "restarts.log").open("a") as log_file:
                log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            group_cfg = replace(group_cfg, ckpt_path=FROM_PEER)


def start_lighthouse(min_replicas: int, heartbeat_timeout_s: float) -> tuple[subprocess.Popen[Any], str]:
    """torchft's Lighthouse (its ``torchft_lighthouse`` program: the launcher imports no torch) on a free port of this
    machine, stopped when this process dies; returns it and its address.

    Raises:
        ValueError: torchft is not installed, or the Lighthouse did not come up (one line).
    """
    program = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    if not Path(program).exists():
        raise ValueError(
            "parallelism.replicas.recovery=torchft needs torchft's Lighthouse (torchft_lighthouse): pip install "
            "'lightning-dist[ft]', or set parallelism.replicas.recovery=restart."
        )
    port = free_port()
    timeouts = {"quorum_tick_ms": 100, "join_timeout_ms": 1000, "heartbeat_timeout_ms": int(heartbeat_timeout_s * 1000)}
    command = [program, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}"]
    command += [f"--{name}={value}" for name, value in timeouts.items()]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_us)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"http://localhost:{port}"
        time.sleep(0.1)
    process.kill()
    raise ValueError(f"torchft's Lighthouse did not come up on port {port} within 30 s ({' '.join(command)}).")


def _die_with_us() -> None:
    """The Lighthouse gets SIGTERM when the launcher dies (Linux), as the ranks do."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
