"""``resume=<run>``: the run continues with its own config, the command line's overrides on top.

Hydra composes a run's config from ``conf/`` and the overrides it was started with, and writes both into the run
folder: ``.hydra/overrides.yaml`` and ``.hydra/config.yaml`` (a later start of the run, a resume, writes its own below
``.hydra/``). :func:`with_run_overrides` puts the overrides of the start that wrote the checkpoint continued (the
ones that composed its ``config.yaml``) before the command line's, so
``lightning-dist-train resume=<run>`` composes the config the run had (its model, data, layout, schedule: an hf LoRA
run is an hf LoRA run again), and ``resume=<run> trainer.max_steps=2000`` that config with one value changed. An
override of the command line replaces the run's of the same key, and a group chosen again (``model=...``) drops the
run's values inside it. Where the run keeps its files (``output_dir``, ``resume``, ``ckpt_path``, ``hydra.*``) is the
command line's alone.

Plain Python and OmegaConf: the launcher runs it before Hydra composes anything.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import OmegaConf

from lightning_dist.checkpoint.folder import complete_checkpoints, pointed
from lightning_dist.environment import resume_folder

#: Keys that say where and how this start runs, not what the run is: never taken from the run's overrides.
_THIS_START = ("resume", "output_dir", "ckpt_path", "resume_allow_changes", "hydra")


def with_run_overrides(args: list[str]) -> list[str]:
    """``args`` (a command line's overrides) after the overrides of the run ``resume=`` names, those ``args``
    replace left out; ``args`` alone when there is no ``resume=`` or the run has no recorded overrides (a run not
    started by the app). Flags (``-m``, ``--cfg``) are kept first."""
    values = {_key(arg): arg.split("=", 1)[1] for arg in args if "=" in arg and not arg.startswith("-")}
    resume = values.get("resume")
    if resume in (None, "", "null") or (resume == "auto" and not values.get("output_dir")):
        return args
    folder = Path(values["output_dir"]) if resume == "auto" else resume_folder(resume)
    recorded = _recorded_overrides(folder, None if resume == "auto" else Path(resume).expanduser())
    if not recorded:
        return args
    kept = [old for old in recorded if not _replaced(_key(old), list(values))]
    flags = [arg for arg in args if arg.startswith("-")]
    return [*flags, *kept, *(arg for arg in args if not arg.startswith("-"))]


def _recorded_overrides(folder: Path, named: Path | None) -> list[str] | None:
    """The overrides of the start that wrote the checkpoint continued (``named``, else the run's newest): the newest
    ``.hydra/**/overrides.yaml`` written before it. A later start refused before launch, or one that saved nothing,
    is not the run's config."""
    checkpoints = folder / "checkpoints"
    continued = named if named is not None and named.parent.name == "checkpoints" else None
    continued = continued or pointed(checkpoints) or next(reversed(complete_checkpoints(checkpoints)), None)
    written = continued.stat().st_mtime if continued is not None and continued.exists() else math.inf
    starts = [path for path in (folder / ".hydra").glob("**/overrides.yaml") if path.stat().st_mtime <= written]
    if not starts:
        return None
    overrides = OmegaConf.to_container(OmegaConf.load(max(starts, key=lambda path: path.stat().st_mtime)))
    return [str(item) for item in overrides] if isinstance(overrides, list) else None


def _key(override: str) -> str:
    """The key (or group) an override sets: ``+model.lora.rank=4`` -> ``model.lora.rank``, ``model=hf`` -> ``model``."""
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".")


def _replaced(key: str, given: list[str]) -> bool:
    """Whether the run's override of ``key`` gives way: the command line sets it, a group holding it (chosen again),
    or it says where this start runs."""
    if key.split(".")[0] in _THIS_START:
        return True
    return any(key == new or key.startswith(f"{new}.") for new in given)
