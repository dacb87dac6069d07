"""Where a run continues from: the run folder and newest whole checkpoint that ``resume`` / ``ckpt_path=last`` / a
torchrun or SLURM restart name, with damaged checkpoints passed over (each named). Whether that checkpoint fits the
run's model is the config's check (:mod:`lightning_dist.config.start`)."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_dist.checkpoint.store import check_loadable, latest_checkpoint, unchecked_note
from lightning_dist.environment import is_global_zero, launcher, restart_count, resume_folder
from lightning_dist.parallel.options import FROM_PEER


def find_start(
    resume: str | None, ckpt_path: str | None, output_dir: str | None, checksums: bool
) -> tuple[str | None, str | None]:
    """``(output_dir, ckpt_path)`` of the run: ``resume`` / ``ckpt_path=last`` / a torchrun or SLURM restart resolved
    into the run folder and the checkpoint it continues from, which is checked to be whole (``checksums``: each
    file's CRC-32 too).

    Raises:
        ValueError: One line naming the value and the fix.
    """
    if ckpt_path == "last":
        resume, ckpt_path = "auto", None
    if ckpt_path == FROM_PEER:  # a replica group rejoining (torchft): a live peer's state, no file
        return output_dir, ckpt_path
    if resume is None and ckpt_path is None:
        ckpt_path = continue_after_external_restart(output_dir, checksums)
    if resume is not None:
        if ckpt_path is not None:
            raise ValueError(f"resume={resume} and ckpt_path={ckpt_path}: set only one of them.")
        run_dir, found = resolve_resume(resume, output_dir, checksums)
        output_dir, ckpt_path = str(run_dir), str(found)
    elif ckpt_path is not None and not Path(ckpt_path).exists():
        raise ValueError(f"ckpt_path={ckpt_path} does not exist; give a checkpoint file or folder.")
    if ckpt_path is not None:
        check_loadable(Path(ckpt_path), checksums)
        unchecked = unchecked_note(Path(ckpt_path))
        if unchecked:
            note(f"warning: {unchecked}")
    return output_dir, ckpt_path


def continue_after_external_restart(output_dir: str | None, checksums: bool) -> str | None:
    """torchrun ``--max-restarts`` or a SLURM requeue started this job again: continue from its newest checkpoint.

    (Its first start into a folder that holds checkpoints is refused, as on every launcher:
    :func:`~lightning_dist.config.cluster_rules.check_new_run_folder`.)
    """
    restarts = restart_count()
    if launcher() not in ("torchrun", "slurm") or restarts == 0:
        return None
    found = newest_whole(Path(output_dir) / "checkpoints", checksums) if output_dir else None
    if found is None:
        return None
    if is_global_zero():
        print(f"restart {restarts}: continuing from {found}", file=sys.stderr, flush=True)
    return str(found)


# ------------------------------------------------------------------------------ what defines the run it continues
#: Data fields that change how the batches are computed, not which samples they hold (a layout choice).
_NOT_THE_STREAM = ("micro_batch_size", "num_workers", "num_proc", "cache_dir")
_LABELS = {"lr_schedule_steps": "the LR schedule's length (optim.decay_steps, else trainer.max_steps)"}


def resolve_resume(resume: str, output_dir: str | None, checksums: bool = True) -> tuple[Path, Path]:
    """The run folder to continue and its newest whole checkpoint, for ``resume=auto`` or ``resume=<path>``.

    ``auto`` continues ``output_dir``; a path names a run folder, its ``checkpoints`` folder, or one checkpoint in it.
    Damaged checkpoints (a file missing, truncated or, with ``checksums``, changed) are passed over, each with one line
    naming the file and the checkpoint used instead.

    Raises:
        ValueError: There is no complete checkpoint to continue from (one line naming where it looked).
    """
    if resume == "auto":
        if output_dir is None:
            raise ValueError("resume=auto continues output_dir, which is not set; pass resume=<run folder>.")
        run_dir = Path(output_dir)
    else:
        path = Path(resume).expanduser().resolve()
        run_dir = resume_folder(resume)
        if path.parent.name == "checkpoints" and path.exists():
            return run_dir, path
    skipped: list[tuple[Path, str]] = []
    found = newest_whole(run_dir / "checkpoints", checksums, skipped)
    if found is None:
        damaged = f" ({'; '.join(f'{path.name}: {problem}' for path, problem in skipped)})" if skipped else ""
        raise ValueError(
            f"resume={resume}: no complete checkpoint in {run_dir / 'checkpoints'}{damaged}; give the folder of the "
            "run to continue (resume=outputs/<date>/<time>), or start a new run without resume."
        )
    return run_dir, found


def newest_whole(dirpath: Path, checksums: bool, skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """:func:`~lightning_dist.checkpoint.store.latest_checkpoint`, printing one line for each damaged checkpoint it
    passes over (rank 0): the file that is wrong and the checkpoint used instead."""
    passed: list[tuple[Path, str]] = []
    found = latest_checkpoint(dirpath, checksums, passed)
    for path, problem in passed:
        instead = f"continuing from {found}" if found is not None else "no whole checkpoint is left"
        note(f"skipped checkpoint {path}: {problem}; {instead}")
    if skipped is not None:
        skipped.extend(passed)
    return found


def note(line: str) -> None:
    """One line on stderr, from rank 0 only (under torchrun / srun every rank checks the config)."""
    if is_global_zero():
        print(line, file=sys.stderr, flush=True)
