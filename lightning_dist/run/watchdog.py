"""Hang detection under torchrun and ``srun``, where no launcher of ours watches the ranks' heartbeats.

Under our own launcher (:mod:`lightning_dist.run.launch`) the parent process reads each rank's beat file. Under
torchrun and srun the ranks beat into the job's shared run folder instead (``<run>/heartbeats/attempt-<k>/<rank>.beat``,
one folder per torchrun restart / SLURM requeue), and a thread in some ranks reads every rank's file: local rank 0
of every node (local ranks 0 and 1 on a one-node job, so a frozen watcher is found by the other). When a rank has
been silent past the allowance it wrote (``resilience.hang_timeout_s``; see :mod:`lightning_dist.callbacks.heartbeat`),
the watching rank prints one line naming the rank silent longest, SIGKILLs the silent ranks on its node and exits
non-zero; torchrun's agent (or ``srun --kill-on-bad-exit``) then stops every rank, and ``--max-restarts`` / a
requeue continues from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path

from lightning_dist.callbacks import beat_file
from lightning_dist.environment import env_int, launcher, restart_count

#: The exit code of a rank whose watchdog found a hung rank.
HUNG_EXIT_CODE = 1


class Watchdog:
    """A daemon thread that reads ``world_size`` beat files in ``folder`` every ``poll_s`` and calls ``on_hang`` once.

    Args:
        folder: Where rank ``r`` beats into ``<r>.beat``.
        world_size: Ranks in the job.
        poll_s: Seconds between two reads of every file.
        on_hang: Called with the one-line message (default: print it, kill the silent ranks on this node, and end
            this process with ``HUNG_EXIT_CODE``).
    """

    def __init__(
        self, folder: Path, world_size: int, poll_s: float = 1.0, on_hang: Callable[[str], None] | None = None
    ) -> None:
        self.folder, self.world_size, self.poll_s = folder, world_size, poll_s
        self.on_hang = on_hang or self._end_job
        self.silent_ranks: list[int] = []  # past their allowance at the last check
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning-dist-watchdog", daemon=True)

    def check(self) -> str | None:
        """The message naming a hung rank, or ``None`` while every rank beats within its allowance."""
        beats = {rank: beat_file.read(self.folder / f"{rank}.beat") for rank in range(self.world_size)}
        silent = beat_file.most_silent(beats)
        if silent is None:
            return None
        # A frozen rank stalls the others in their next collective: every silent rank is one of them.
        self.silent_ranks = [rank for rank, beat in beats.items() if beat is not None and beat[2] > beat[1]]
        return beat_file.hung_message(*silent)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _end_job(self, message: str) -> None:
        """Print ``message``; SIGKILL the silent ranks that run on this node (a frozen or deadlocked process ignores
        the SIGTERM its launcher sends, which torchrun follows with SIGKILL only 30 s later); exit this process.

        Which silent rank stopped first cannot be told from beats written at most once a second: the message names
        the one silent longest, and every silent rank here is ended.
        """
        print(f"error: {message}", file=sys.stderr, flush=True)
        for rank in self.silent_ranks:
            writer = beat_file.writer(self.folder / f"{rank}.beat")
            if writer is not None and writer[1] == socket.gethostname() and writer[0] != os.getpid():
                with contextlib.suppress(OSError):  # gone already
                    os.kill(writer[0], signal.SIGKILL)
        os._exit(HUNG_EXIT_CODE)  # the main thread may be blocked in a collective: no clean shutdown is possible

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            message = self.check()
            if message is not None and not self._stopped.is_set():
                self.on_hang(message)
                return


def watch_external_job(out_dir: Path, env: MutableMapping[str, str] | None = None) -> Watchdog | None:
    """Under torchrun / srun: make this rank beat into the run folder and, on a watching rank, start the watchdog.

    Returns:
        The started watchdog (stop it when training ends), or ``None`` (another launcher, or a rank that only beats).
    """
    env = os.environ if env is None else env  # read now: a library may rebind os.environ
    kind = launcher(env)
    if kind not in ("torchrun", "slurm"):
        return None
    if kind == "torchrun":
        rank, world, local = (env_int(env.get(name)) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        per_node = env_int(env.get("LOCAL_WORLD_SIZE")) or world
    else:
        rank, world, local = (env_int(env.get(name)) for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        per_node = world // max(1, env_int(env.get("SLURM_NNODES")))
    folder = out_dir / "heartbeats" / f"attempt-{restart_count(env)}"  # a restart's beats start afresh
    folder.mkdir(parents=True, exist_ok=True)
    env[beat_file.ENV] = str(folder / f"{rank}.beat")
    watchers = (0,) if per_node < world else (0, 1)
    if local not in watchers:
        return None
    return Watchdog(folder, world, poll_s=max(1.0, world / 256)).start()  # a read per rank and poll: bounded I/O
