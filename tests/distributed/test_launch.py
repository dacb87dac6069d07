"""The launcher: results come back by rank, and a dead or failing rank ends the job with a message, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from lightning_dist.run.launch import RankFailedError, launch


def _rank_and_sum() -> tuple[int, int]:
    import torch

    dist.init_process_group("gloo")
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value)
    return dist.get_rank(), int(value)


def _rank_one_dies_while_others_wait() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(3)  # a crash without a Python exception, like an OOM kill
    dist.barrier()  # rank 0 would wait here forever without the launcher


def _rank_one_is_killed() -> None:
    import signal

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    dist.barrier()


def _rank_one_raises() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("data.path='x' matched no file")
    dist.barrier()


class BadPath(ValueError):
    """A bad value whose one-line message starts with its own class name, not "ValueError"."""


def _raises_bad_path() -> None:
    raise BadPath("data.path='x' matched no file")


def _rank_one_hangs_on_the_way_out(work_s: float) -> int:
    import atexit

    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(work_s)  # slow work, not a hang: the grace period starts only once every rank has delivered
        atexit.register(time.sleep, 3600)  # a native destructor that never returns
    return rank


def _finishes_then_runs_atexit(marker_dir: str, abort_on_exit: bool) -> int:
    import atexit
    from pathlib import Path

    dist.init_process_group("gloo")
    # Gloo connects every pair while init_process_group returns: a rank that left at once could close its side
    # before the other finished connecting ("connectFullMesh ... Connection closed by peer", 2 runs in ~8 on CI).
    dist.barrier()
    rank = dist.get_rank()
    atexit.register(lambda: (Path(marker_dir) / f"atexit-{rank}").touch())  # like wandb's and logging's handlers
    if abort_on_exit and rank == 1:
        atexit.register(os.abort)  # a native crash on the way out, after the work is done (gloo's destructors in CI)
    return rank


def test_results_come_back_by_rank() -> None:
    assert launch(_rank_and_sum, 2) == [(0, 3), (1, 3)]


def test_a_dead_rank_ends_the_job_quickly_with_its_exit_code() -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailedError, match=r"rank 1: died \(exit code 3\)") as info:
        launch(_rank_one_dies_while_others_wait, 2)
    assert time.perf_counter() - start < 60
    assert (info.value.kind, info.value.exc_type, info.value.will_repeat) == ("died", None, False)  # may be transient


def test_a_failing_rank_reports_its_own_error_not_the_others() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1: ValueError: data.path='x' matched no file") as info:
        launch(_rank_one_raises, 2)
    assert "Traceback" in info.value.details
    # The rank recorded its exception's class; a bad value would only fail again, so the app does not restart it.
    assert (info.value.kind, info.value.exc_type, info.value.will_repeat) == ("raised", "builtins.ValueError", True)


def test_a_rank_reports_its_exception_class_and_whether_a_restart_would_repeat_it() -> None:
    """Decided in the rank from the class (a ValueError subclass repeats), not from the message's text."""
    with pytest.raises(RankFailedError, match=r"rank 0: BadPath: data.path='x' matched no file") as info:
        launch(_raises_bad_path, 1)
    assert (info.value.exc_type, info.value.will_repeat) == (f"{__name__}.BadPath", True)


def test_a_killed_rank_is_named_as_the_cause() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1: was killed by signal SIGKILL"):
        launch(_rank_one_is_killed, 2)


def test_atexit_handlers_run_in_every_rank(tmp_path) -> None:
    """Ranks leave with os._exit to skip a shutdown that can abort; W&B and logging still finish in atexit."""
    assert launch(_finishes_then_runs_atexit, 2, str(tmp_path), False) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit-0", "atexit-1"]


def test_a_crash_after_the_result_is_a_warning_not_a_failed_job(tmp_path) -> None:
    """CI saw SIGABRT ("terminate called without an active exception") from a pipeline rank that had finished."""
    with pytest.warns(RuntimeWarning, match=r"rank 1 was killed by signal SIGABRT after returning its result"):
        assert launch(_finishes_then_runs_atexit, 2, str(tmp_path), True) == [0, 1]


def test_a_hang_after_the_result_is_cut_short_with_a_warning() -> None:
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"rank 1 had not exited 1 s after returning its result; terminated"):
        assert launch(_rank_one_hangs_on_the_way_out, 2, 3.0, exit_grace_s=1.0) == [0, 1]
    assert time.monotonic() - start < 30  # 3 s of work + 1 s of grace + start-up, not the hour of the hang


def test_a_rank_ends_when_its_launcher_is_gone() -> None:
    """SIGKILL to the main process cannot be forwarded: every rank watches its launcher and exits without it."""
    import subprocess
    import sys
    import time

    launcher = subprocess.Popen(["sleep", "60"])
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; from lightning_dist.run.launch import _exit_with_launcher; "
         f"_exit_with_launcher({launcher.pid}); print('watching', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert rank.stdout.readline().strip() == "watching"
    launcher.kill()
    launcher.wait()
    killed = time.monotonic()
    assert rank.wait(timeout=30) == 1
    assert time.monotonic() - killed < 30  # checked every second


def _wait_for_sigterm(ready: str) -> str:
    """A rank that waits, as a training rank does, for the launcher's SIGTERM (what Ctrl-C becomes)."""
    import signal
    from pathlib import Path

    received = []
    signal.signal(signal.SIGTERM, lambda *_: received.append(True))
    Path(ready, os.environ["RANK"]).touch()
    while not received:
        time.sleep(0.05)
    return "SIGTERM"


def test_ctrl_c_to_the_main_process_reaches_every_rank_and_the_job_ends(tmp_path) -> None:
    """SIGINT to the main process alone: each rank gets SIGTERM (its cue to save and stop) and the launcher returns;
    it once sat in multiprocessing's exit join for minutes while the ranks trained on."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = ("from test_launch import _wait_for_sigterm; from lightning_dist.run.launch import launch; "
            f"print(launch(_wait_for_sigterm, 2, {str(tmp_path)!r}), flush=True)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.iterdir())) < 2:
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGINT)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 0 and "['SIGTERM', 'SIGTERM']" in out
