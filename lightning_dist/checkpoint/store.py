"""Sharded checkpoints (``torch.distributed.checkpoint``) for every layout, pipelines included.

Parameter names are always the full model's (pipeline splitting keeps them), and the optimizer state is stored
flattened, one key per parameter (``state.layers.0.w.exp_avg``, ``param_groups.layers.0.w.lr``). Lightning's nested
form has one ``param_groups`` entry per optimizer, which DCP keeps from a single rank; pipeline ranks hold different
parameters, so the others would lose their groups on load (torchtitan flattens too). So every rank saves and loads
exactly its own keys. DCP keeps one copy of a tensor several ranks hold alike (same key, same shard); ranks whose
values differ (DiLoCo's replicas between outer steps) save theirs under a key of their own (:func:`load_sharded`'s
``under``), resharded as any other.
"""

from __future__ import annotations

import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_dist import _compat
from lightning_dist.checkpoint.folder import (
    EXPORT_MARKER,
    HF_FOLDER,
    MANIFEST,
    complete_checkpoints,
    export_problem,
    has_manifest,
    pointed,
)
from lightning_dist.manifest import manifest_problem, read_manifest

_OPTIM_STATE_SAVE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
_OPTIM_STATE_LOAD = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened, CPU-offloaded state of ``optimizer`` over ``model``'s parameters, as DCP saves it."""
    return get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_SAVE)


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    under: str = "",
    extra: dict[str, Any] | None = None,
) -> None:
    """Load the sharded checkpoint folder ``path`` into ``model`` and ``optimizers`` in place, under any layout.

    Every rank asks DCP for exactly the keys its model and optimizers hold (plain tensors of a pipeline stage and
    DTensors of TP / FSDP2 alike), so a rank's stages and shards are filled from whatever layout wrote the files.
    ``under``: the key they were saved under (:func:`save`; ``""``: the top level, as every run saves them);
    ``extra``: more tensors to fill in place from the same read (laid out as they were given to :func:`save`).
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_LOAD)
    dcp.load({under: state, **(extra or {})} if under else {**state, **(extra or {})}, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_STATE_LOAD)


def read_rest(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """The rest of Lightning's checkpoint in the folder ``path`` (loops, callbacks, LR schedulers, ...)."""
    return torch.load(path / _compat.checkpoint_metadata_file(), weights_only=weights_only)


#: The key of Lightning's checkpoint under which a run notes what defines it (its seed, data, batch, LR schedule).
RUN_RECORD = "lightning_dist_run"
#: The key of Lightning's checkpoint under which :class:`~lightning_dist.callbacks.checkpoints.RunCheckpoints` notes
#: that the folder is published with a manifest: one without it lost it (a checkpoint holding :data:`RUN_RECORD` was
#: written after manifests existed too).
MANIFEST_NOTE = "lightning_dist_manifest"


def run_record_of(path: Path) -> dict[str, Any] | None:
    """What the run that saved the checkpoint ``path`` noted under :data:`RUN_RECORD`; ``None`` if nothing."""
    path = Path(path)
    try:
        rest = read_rest(path, False) if path.is_dir() else torch.load(path, "cpu", weights_only=False, mmap=True)
    except Exception:  # unreadable: damage() said so already, or this is not ours to judge
        return None
    return rest.get(RUN_RECORD) if isinstance(rest, dict) else None


def step_of(path: Path) -> int | None:
    """The optimizer steps taken when the checkpoint ``path`` was saved (Lightning's ``global_step``); ``None`` when
    it cannot be read."""
    path = Path(path)
    try:
        rest = read_rest(path, False) if path.is_dir() else torch.load(path, "cpu", weights_only=False, mmap=True)
    except Exception:  # unreadable: damage() said so already
        return None
    step = rest.get("global_step") if isinstance(rest, dict) else None
    return int(step) if isinstance(step, int) else None


def sharded_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What of Lightning's ``checkpoint`` DCP writes (taken out of it): ``state_dict`` and each ``optimizer_<i>``."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def save(state: dict[str, Any], rest: dict[str, Any], path: Path, global_rank: int, group: Any = None) -> Any:
    """Write ``state`` (:func:`sharded_state`, and any keys of this rank's own) through DCP to the folder ``path``
    and Lightning's ``rest`` into one file from rank 0: Lightning's sharded layout. Returns ``None``, or with a
    ``group`` the background write's future.

    With ``group``, a gloo group of its own (its collectives never run beside the training's on one group), DCP copies
    the state to host memory before this returns, so training may change the weights at once; the folder is complete
    when rank 0's future is done (DCP writes ``.metadata`` after every rank's data).
    """
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    future = None
    if group is None:
        dcp.save(state, checkpoint_id=path)
    else:
        future = dcp.async_save(state, checkpoint_id=path, process_group=group)
    if global_rank == 0:
        torch.save(rest, path / _compat.checkpoint_metadata_file())
    return future


# ------------------------------------------------------------------------------------------ during the run
def latest_checkpoint(
    dirpath: Path, checksums: bool = True, skipped: list[tuple[Path, str]] | None = None
) -> Path | None:
    """The checkpoint the ``latest`` file names, else the newest published one that is whole; ``None`` if none.

    Args:
        dirpath: A run's checkpoint folder.
        checksums: Check every file's CRC-32 against the manifest too (reads the checkpoint once); else sizes only.
        skipped: Gets ``(checkpoint, what is wrong with it)`` for each damaged one passed over, newest first.
    """
    named = pointed(dirpath)
    candidates = [named] if named is not None else []
    candidates += [path for path in reversed(complete_checkpoints(dirpath)) if path != named]
    for path in candidates:  # newest first, stopping at the first whole one: older ones are not read
        problem = damage(path, checksums)
        if problem is None:
            return path
        if skipped is not None:
            skipped.append((path, problem))
    return None


def damage(path: Path, checksums: bool = True) -> str | None:
    """Why the checkpoint ``path`` cannot be loaded (a file missing, truncated or changed), or ``None`` if it is whole.

    A sharded folder needs DCP's ``.metadata`` and Lightning's file, and each file its size and (``checksums``) CRC-32
    of the manifest written when it was published (:mod:`~lightning_dist.checkpoint.folder`), those of its ``hf/``
    folder too. A folder written before manifests existed is checked by size only: each shard file at least as long as
    DCP's index says; one whose Lightning file says it was published with a manifest (:data:`MANIFEST_NOTE`,
    :data:`RUN_RECORD`) and has none is damaged (the manifest was removed: its files cannot be checked). A single file
    is a zip archive (``torch.save``) whose directory, at its end, is readable and (``checksums``) whose members match
    the CRC-32 the archive keeps for each. Repeated checks of an unchanged checkpoint are answered from memory.
    """
    path = Path(path)
    try:
        key = (str(path.resolve()), checksums, _signature(path))
    except OSError:  # gone, or a file removed while listed (pruned): checked as it is now
        return _damage(path, checksums)
    if key not in _VERDICTS:
        _VERDICTS[key] = _damage(path, checksums)
    return _VERDICTS[key]


_VERDICTS: dict[tuple, str | None] = {}  # (checkpoint, checksums, its files' names, sizes and times) -> damage()


def _signature(path: Path) -> tuple:
    """What a remembered verdict on ``path`` holds for: each file's name, size and modification time (subfolders'
    files too: ``hf/``)."""
    if not path.is_dir():
        stat = path.stat()
        return (stat.st_size, stat.st_mtime_ns)
    files = (p for p in path.rglob("*") if not p.is_dir())
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def _damage(path: Path, checksums: bool) -> str | None:
    if path.is_dir():
        missing = [name for name in (".metadata", _compat.checkpoint_metadata_file()) if not (path / name).is_file()]
        if missing:
            return f"missing {', '.join(missing)}"
        if has_manifest(path):
            return manifest_problem(path, checksums)
        return _size_problem(path) or _lost_manifest(path)
    if not path.is_file():
        return "no such file or folder"
    if not zipfile.is_zipfile(path):
        return "not a complete torch.save archive (truncated?)"
    if not checksums:
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member against the CRC-32 its entry keeps
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as err:
        return f"its archive cannot be read ({err})"
    return f"its member {bad} does not match the CRC-32 the archive keeps (its bytes changed)" if bad else None


def _size_problem(path: Path) -> str | None:
    """A folder without a manifest: DCP's index readable, and each shard file as long as the index says."""
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception:  # an unpickling error of any kind: the file was cut short or changed
        return ".metadata cannot be read (truncated?)"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None:
            return f"{name} is missing"
        if have < size:
            return f"{name} has {have} bytes, fewer than the {size} its .metadata indexes (truncated?)"
    if not zipfile.is_zipfile(path / _compat.checkpoint_metadata_file()):
        return f"{_compat.checkpoint_metadata_file()} is not a complete torch.save archive (truncated?)"
    return None


def _lost_manifest(path: Path) -> str | None:
    """A sharded checkpoint without a manifest whose Lightning file says it was published with one: damaged."""
    try:
        rest = read_rest(path, False)
    except Exception:  # _size_problem found the file whole: a file that unpickles to nothing of ours says nothing
        return None
    if isinstance(rest, dict) and (MANIFEST_NOTE in rest or RUN_RECORD in rest):
        return f"its {MANIFEST} is missing (it was published with one: removed?), so its files cannot be checked"
    return None


def unchecked_note(path: Path) -> str | None:
    """A line for a sharded checkpoint without a manifest (written before manifests existed): only sizes checked; or
    with a manifest older than its ``hf/`` folder's cover (version 1): that folder is not checked."""
    path = Path(path)
    if path.is_dir() and not has_manifest(path):
        return (
            f"checkpoint {path} has no {MANIFEST} (written before checkpoints had one): only its files' sizes were "
            "checked, not their contents"
        )
    manifest = read_manifest(path) if path.is_dir() and (path / HF_FOLDER).is_dir() else None
    if manifest is not None and int(manifest.get("version", 1)) < 2:
        return (
            f"checkpoint {path}'s {MANIFEST} (version 1) does not cover its {HF_FOLDER}/ folder: those files are not "
            "checked"
        )
    return None


# ------------------------------------------------------------------------------ HuggingFace folders we wrote
def hf_folder_problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with a HuggingFace or peft adapter folder this project wrote, before it is read: a checkpoint's
    ``hf/`` against the checkpoint's manifest (its entries under ``hf/``; a file added there is wrong too), an export
    against its :data:`~lightning_dist.checkpoint.folder.EXPORT_MARKER`; ``None`` when it is whole, and for a folder of
    anyone else's (a hub download, a user's ``save_pretrained``: there is nothing to check it against)."""
    folder = Path(folder)
    if (folder / EXPORT_MARKER).is_file():
        return export_problem(folder, checksums)
    checkpoint = folder.parent
    if folder.name != HF_FOLDER or not (checkpoint / ".metadata").is_file():
        return None
    if not has_manifest(checkpoint):
        return _lost_manifest(checkpoint)  # else an older checkpoint: nothing to check against (unchecked_note)
    manifest = read_manifest(checkpoint)
    if manifest is None:
        return f"its checkpoint's {MANIFEST} cannot be read (truncated?)"
    if int(manifest.get("version", 1)) < 2:
        return None  # written before manifests covered hf/ (unchecked_note says so)
    return manifest_problem(checkpoint, checksums, under=f"{HF_FOLDER}/", unlisted=True)


def check_hf_folder(folder: Path, checksums: bool = True) -> None:
    """Raise one line naming ``folder``, what is wrong with it and what to read instead (:func:`hf_folder_problem`).

    Raises:
        ValueError: The folder is damaged.
    """
    problem = hf_folder_problem(folder, checksums)
    if problem is None:
        return
    folder = Path(folder)
    if (folder / EXPORT_MARKER).is_file():
        source = (read_manifest(folder, EXPORT_MARKER) or {}).get("source", "its checkpoint")
        fix = f"export it again: lightning-dist-export {source} {folder} --overwrite"
    else:
        good = latest_checkpoint(folder.parent.parent, checksums)
        fix = f"the newest whole checkpoint there is {good}" if good else "there is no whole checkpoint beside it"
    raise ValueError(f"{folder} cannot be loaded ({problem}); {fix}.")


def check_loadable(path: Path, checksums: bool = True) -> None:
    """Raise one line naming ``path``, what is wrong with it and the newest whole checkpoint beside it.

    Raises:
        ValueError: The checkpoint is damaged.
    """
    problem = damage(path, checksums)
    if problem is None:
        return
    good = latest_checkpoint(Path(path).parent, checksums)
    fallback = f"the newest whole checkpoint there is {good}" if good else "there is no whole checkpoint beside it"
    raise ValueError(f"checkpoint {path} cannot be loaded ({problem}); {fallback}.")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
