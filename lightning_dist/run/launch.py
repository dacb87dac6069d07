"""Start the ranks of a single-node job ourselves and collect what each returns.

Lightning's own launcher re-runs the script (``sys.argv``) once per rank, which breaks Hydra multiruns: every
re-run starts the whole sweep again. Here the Hydra job (or a test) calls :func:`launch` with a picklable function;
each rank is a fresh process (forked from a server that has torch and Lightning imported, else spawned) with the
launching process's environment and working directory plus the torchrun-style variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) so Lightning sees processes created externally and does not
launch again. When a rank fails or dies, the others are terminated and :class:`RankFailedError` says which rank
and why: a dead rank never leaves the job hanging.

The launching process itself needs neither torch nor Lightning (the standard library starts the ranks); what runs in
a rank imports torch there, where the forkserver has loaded it already.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from typing import Any

from lightning_dist import environment
from lightning_dist._compat import run_atexit_handlers
from lightning_dist.callbacks import beat_file
from lightning_dist.errors import LightningDistError, restart_would_repeat

#: How long ranks get to reach a step boundary and save after the launcher forwarded a signal.
SHUTDOWN_GRACE_S = 300.0

#: Imported once by the forkserver, so that every rank starts with them loaded: what a training rank imports, and
#: what each rank's re-run of ``lightning-dist-train`` (the main script, as multiprocessing does) imports.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_dist.run.fit", "lightning_dist.run.train"]

#: ``prctl(PR_SET_NAME)``: the calling thread's name, the process's for its main thread (Linux).
_PR_SET_NAME = 15
#: ``prctl(PR_SET_PDEATHSIG)``: the signal a rank gets when the process that forked it dies (Linux).
_PR_SET_PDEATHSIG = 1


class RankFailedError(LightningDistError, RuntimeError):
    """A rank raised, died or hung; ``message`` is the one-line reason and ``details`` the rank's traceback.

    Attributes:
        rank: The rank named as the cause.
        message: One line, e.g. ``ValueError: data.path='x' matched no file`` or ``died (exit code 3)``.
        details: The rank's traceback ("" when it did not raise).
        kind: ``"raised"`` (a Python exception), ``"died"`` (exited or was killed without one) or ``"hung"``.
        exc_type: The qualified class name of the rank's exception (``lightning_dist.errors.NonFiniteError``),
            recorded in the rank itself; ``None`` unless ``kind`` is ``"raised"``.
        will_repeat: Whether a restart would only fail the same way, decided in the rank from the exception's class
            (:func:`lightning_dist.errors.restart_would_repeat`); ``False`` for a death or a hang.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        details: str = "",
        *,
        kind: str = "died",
        exc_type: str | None = None,
        will_repeat: bool = False,
    ) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.message = message
        self.details = details
        self.kind = kind
        self.exc_type = exc_type
        self.will_repeat = will_repeat


def launched_externally() -> bool:
    """True when this process is already one rank of a launched job (ours, torchrun or SLURM's srun).

    Only a launcher's full set of variables counts (see :func:`lightning_dist.environment.launcher`).
    """
    return environment.launcher() is not None


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    threads_per_rank: int | None = None,
    exit_grace_s: float = 60.0,
    env: dict[str, str] | None = None,
    name: str = "ld-rank",
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned ranks of one node and return each rank's result, by rank.

    Args:
        fn: A picklable (module-level) function. Its return value must be picklable.
        nprocs: Number of ranks to start. ``1`` still starts a separate process, so a single-rank run is
            isolated exactly like a multi-rank one.
        *args: Passed to ``fn`` on every rank.
        threads_per_rank: CPU threads per rank; default shares the machine's cores evenly.
        exit_grace_s: Once every rank still running has returned its result, how long to wait for them to exit
            before terminating them (a native destructor that hangs on the way out must not hang the job).
        env: Variables the ranks get besides the launching process's environment.
        name: What ``ps`` and ``top`` call the ranks: ``<name><rank>`` (at most 15 characters, Linux).

    Raises:
        RankFailedError: The first rank that raised or died, with its one-line reason.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be >= 1.")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    env = {
        **os.environ,  # a rank forked from the server gets the launching process's environment, as a spawned one does
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "NODE_RANK": "0",
        environment.OURS_ENV: str(os.getpid()),
    }
    with tempfile.TemporaryDirectory(prefix="lightning-dist-") as tmp:
        results = Path(tmp)
        context = multiprocessing.get_context(_start_method())
        processes = []
        for rank in range(nprocs):
            rank_args = (rank, fn, args, env, os.getcwd(), threads, results, f"{name}{rank}")
            processes.append(context.Process(target=_start_rank, args=rank_args, daemon=False))
            processes[-1].start()
        with _forward_signals(processes):
            _wait_for_ranks(processes, results, exit_grace_s)
        return [pickle.loads((results / f"{rank}.out").read_bytes()) for rank in range(nprocs)]


@contextmanager
def _forward_signals(processes: list) -> Iterator[None]:
    """SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 to the launcher go to every rank as SIGTERM: they stop at the next step
    boundary and save (see :mod:`lightning_dist.callbacks.preemption`). A second signal, or ranks still running
    ``SHUTDOWN_GRACE_S`` after the first, are killed: no rank outlives the job."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        hard = len(received) > 1
        for process in processes:
            if process.is_alive():
                process.kill() if hard else process.terminate()
        if not hard:
            deadline = threading.Timer(SHUTDOWN_GRACE_S, lambda: [p.kill() for p in processes if p.is_alive()])
            deadline.daemon = True
            deadline.start()

    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    previous = {signum: signal.signal(signum, forward) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start_method() -> str:
    """``forkserver`` with torch and Lightning imported in the server, where the platform has it; else ``spawn``.

    A rank forked from the server starts with those imports done (several seconds of CPU per rank saved, which is
    most of a short job's start-up on a small machine), yet from a clean process: the server never runs a step, makes
    a process group or touches CUDA.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _wait_for_ranks(processes: list, results: Path, exit_grace_s: float) -> None:
    """Wait for every rank; on the first one that fails before delivering its result, stop the rest and raise.

    A rank that dies *after* writing its result (a crash in native destructors on the way out) has done its work:
    that is a warning naming the rank, not a failed job. So is one that has not exited ``exit_grace_s`` after every
    running rank delivered (a hang on the way out): it is terminated.
    """
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    all_delivered_at: float | None = None
    while running:
        exited = wait_for_exit(list(running), timeout=1.0)
        if not exited:
            _check_heartbeats(processes, results, sorted(running.values()))
            if not all((results / f"{rank}.out").exists() for rank in running.values()):
                continue
            all_delivered_at = all_delivered_at or time.monotonic()
            if time.monotonic() - all_delivered_at < exit_grace_s:
                continue
            for rank in sorted(running.values()):
                _stop(processes[rank])
                message = f"rank {rank} had not exited {exit_grace_s:g} s after returning its result; terminated."
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            return
        for sentinel in exited:
            rank = running.pop(sentinel)
            processes[rank].join()
            code = processes[rank].exitcode
            if code == 0:
                continue
            if (results / f"{rank}.out").exists():
                message = f"rank {rank} {_exit_reason(code)} after returning its result."
                warnings.warn(message, RuntimeWarning, stacklevel=3)  # points at the caller of launch()
                continue
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join()
            raise _failure(results, [process.exitcode for process in processes], rank)


def _check_heartbeats(processes: list, results: Path, ranks: list[int]) -> None:
    """End the job when a rank has been silent for longer than it allowed (:mod:`lightning_dist.callbacks.heartbeat`;
    :func:`~lightning_dist.callbacks.beat_file.most_silent` names it)."""
    silent = beat_file.most_silent({rank: beat_file.read(results / f"{rank}.beat") for rank in ranks})
    if silent is None:
        return
    for process in processes:
        if process.is_alive():
            process.kill()  # a frozen (SIGSTOP) or deadlocked process does not act on SIGTERM
    for process in processes:
        process.join()
    rank, step, allowed, age = silent
    message = beat_file.hung_message(rank, step, allowed, age).removeprefix(f"rank {rank}: ")
    raise RankFailedError(rank, message, kind="hung")


def _stop(process: Any) -> None:
    """SIGTERM, then SIGKILL if the process ignores it (a thread stuck in native code may)."""
    process.terminate()
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()


def _start_rank(local_rank: int, *rank_args: Any) -> None:
    """A rank's first call, as ``torch.multiprocessing``'s spawn wrapper makes it: the rank gets SIGINT when the process
    that forked it dies, an interrupt ends it quietly, and an exception (recorded by :func:`_run_rank`) exits with 1,
    its traceback in the rank's ``.err`` file rather than on the job's stderr."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGINT)
    try:
        _run_rank(local_rank, *rank_args)
    except KeyboardInterrupt:
        pass  # SIGINT: stopped by its parent
    except Exception:
        sys.exit(1)


def _name_process(name: str) -> None:
    """``ps`` / ``top`` show ``name`` for this process instead of the forkserver's ``python`` (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


def _run_rank(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    cwd: str,
    threads: int,
    results: Path,
    name: str,
) -> None:
    import torch  # deferred: loaded in the rank already (the forkserver's preload), never in the launcher

    os.environ.clear()  # the server's environment is the one it started with: take the launching process's
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    os.environ[beat_file.ENV] = str(results / f"{local_rank}.beat")
    os.chdir(cwd)
    _exit_with_launcher(int(env[environment.OURS_ENV]))
    _name_process(name)

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException as err:
        record = {
            "message": f"{type(err).__name__}: {err}".splitlines()[0],
            "details": traceback.format_exc(),
            # The class is known here only: the launcher decides a restart by it, not by the message's text.
            "exc_type": f"{type(err).__module__}.{type(err).__qualname__}",
            "will_repeat": restart_would_repeat(type(err)),
        }
        (results / f"{local_rank}.err").write_bytes(pickle.dumps(record))
        raise
    # Written whole, then renamed: the launcher takes an existing .out as "this rank delivered".
    partial = results / f"{local_rank}.out.partial"
    partial.write_bytes(pickle.dumps(result))
    os.replace(partial, results / f"{local_rank}.out")
    _exit_without_finalization()


def _exit_with_launcher(launcher_pid: int) -> None:
    """A rank ends itself when its launcher is gone (killed with SIGKILL, which cannot be forwarded): no orphans."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _exit_without_finalization() -> None:
    """End a rank whose work succeeded, skipping the interpreter's shutdown.

    Gloo's worker threads can still hold finished async work (pipeline sends and receives) whose tensors point back
    into Python; when interpreter finalization destroys them, the process aborts ("terminate called without an active
    exception", SIGABRT) at random, after the result was written, and the launcher would report a finished rank as
    dead (seen in CI on pipeline tests, pytorch/pytorch#179291). So: close the process groups, run the atexit
    handlers while the interpreter is whole (W&B, logging), flush, and leave with ``os._exit``.
    """
    import torch.distributed as dist  # deferred: loaded in the rank already, never in the launcher

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    run_atexit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure(results: Path, exit_codes: list[int | None], first_noticed: int) -> RankFailedError:
    """The root cause among the failed ranks.

    A rank that died without raising (a crash, an OOM kill) comes first: the others then fail only because their
    peer is gone ("connection closed"). Otherwise the exception recorded first wins. Ranks the launcher itself
    terminated afterwards (SIGTERM) are never the cause.
    """
    recorded = {int(p.stem): p for p in results.glob("*.err")}
    for rank, code in enumerate(exit_codes):
        if code is None or code == 0 or rank in recorded or code == -signal.SIGTERM:
            continue
        return RankFailedError(rank, _exit_reason(code))
    if recorded:
        rank = min(recorded, key=lambda r: (recorded[r].stat().st_mtime_ns, r))
        record = pickle.loads(recorded[rank].read_bytes())
        return RankFailedError(
            rank,
            record["message"],
            record["details"],
            kind="raised",
            exc_type=record["exc_type"],
            will_repeat=record["will_repeat"],
        )
    return RankFailedError(first_noticed, f"failed (exit code {exit_codes[first_noticed]})")


def _exit_reason(code: int) -> str:
    return f"died (exit code {code})" if code > 0 else f"was killed by signal {signal.Signals(-code).name}"
