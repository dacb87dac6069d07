"""A write that fails for want of space mid-run (a full disk, a quota, a file-size limit) ends the job with one line
naming the OS's reason and what is left on disk (the newest whole checkpoint, the incomplete save), not ~190 lines of
each rank's traceback around DCP's ``CheckpointException`` (whose own message names only the ranks). Real: two FSDP
ranks whose sharded save hits the process's file-size limit (EFBIG, "File too large": what a test can impose without
a filesystem of its own); the disk-full wording (ENOSPC, a free-space check) is tested below on a faked ``statvfs``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from helpers import FAST, fresh_env

LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))  # the ranks inherit it: their shards do not fit
from lightning_dist.run.train import main
sys.argv = ["lightning-dist-train", *sys.argv[1:]]
main()
"""


def test_a_save_that_runs_out_of_space_is_one_line_saying_so_and_what_is_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*FAST, "parallelism=fsdp", "cluster.devices=2", "trainer.max_steps=4"]
    overrides += ["trainer.enable_checkpointing=true", "checkpoint.every_n_steps=2", f"output_dir={run_dir}"]
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env=fresh_env(WANDB_MODE="offline", PYTHONWARNINGS="ignore"),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "CheckpointException ranks" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert line.startswith("error: rank ") and ": OSError: [Errno 27] File too large" in line, line
    partial = run_dir / "checkpoints" / ".step-00000002.partial"
    assert line.endswith(
        f"; left on disk: no whole checkpoint, an incomplete save {partial} (never loaded: remove it to free its space)"
    ), line


def test_a_full_disk_is_named_even_where_the_writer_does_not_say_it(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer reports a short write as "unexpected pos 704 vs 598": the run folder's free space is
    checked, and the line names the full disk. The newest whole checkpoint is what resume continues from."""
    from lightning_dist.run import train

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-00000004").mkdir(parents=True)
    (checkpoints / "latest").write_text("step-00000004\n")
    (checkpoints / ".step-00000006.partial").mkdir()
    monkeypatch.setattr(train.os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    said = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    assert train.left_on_disk(tmp_path, said) == (
        f"; its disk is full (No space left on device: 0 bytes free); left on disk: {checkpoints / 'step-00000004'} "
        f"(resume={tmp_path} continues from it), an incomplete save {checkpoints / '.step-00000006.partial'} (never "
        "loaded: remove it to free its space)"
    )
    assert train.left_on_disk(tmp_path, "OSError: [Errno 28] No space left on device").startswith(
        "; its disk is full (0 bytes free); left on disk: "
    )


def test_the_os_error_inside_dcps_checkpoint_exception_is_the_cause() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_dist._compat import root_cause

    full = OSError(28, "No space left on device")
    wrapped = CheckpointException("save", {0: (RuntimeError("unexpected pos 704 vs 598"), None), 1: (full, None)})
    assert root_cause(wrapped) is full
    assert root_cause(ValueError("x")).args == ("x",)
