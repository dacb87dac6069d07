"""The app's own lines (start-up layout, notes, the end-of-run summary, restarts): printed as they always were, and
written with a timestamp to the run folder's ``train.log`` too (the file Hydra creates for the job).

Each process that says something (the launcher, rank 0) opens the file itself; Lightning's and W&B's own output
stays on the terminal only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

#: The file in the run folder (Hydra's job log: ``<hydra.job.name>.log``).
LOG_FILE = "train.log"

_log = logging.getLogger("lightning_dist.app")
_log.propagate = False  # not through Hydra's root handlers: the terminal gets the bare line from print()
_log.setLevel(logging.INFO)


def log_to(out_dir: Path | str) -> Path:
    """From now on, this process's lines also go to ``<out_dir>/train.log`` (appended; replaces an earlier folder)."""
    path = Path(out_dir) / LOG_FILE
    for handler in [handler for handler in _log.handlers if isinstance(handler, logging.FileHandler)]:
        if Path(handler.baseFilename) == path.resolve():
            return path
        _log.removeHandler(handler)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    _log.addHandler(handler)
    return path


def say(message: str, *, err: bool = False) -> None:
    """Print ``message`` (to stderr with ``err``) and write it to the run folder's log file, once one is set."""
    print(message, file=sys.stderr if err else sys.stdout, flush=True)
    _log.log(logging.WARNING if err else logging.INFO, message)
