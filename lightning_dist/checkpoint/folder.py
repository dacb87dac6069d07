"""A run's checkpoint folder as files: the published checkpoints, the ``latest`` pointer, and each checkpoint's
manifest (every file's size and CRC-32: :mod:`lightning_dist.manifest`), written when it is published and checked
before it is loaded or exported.

No torch here: the launcher finds a run's checkpoints and checks a manifest without it (``tests/unit/test_layering.py``,
``test_startup_imports.py``).

**The manifest** (``manifest.json`` in a sharded checkpoint folder) names every file of the folder with its size and
the CRC-32 of its bytes, those in its subfolders too (``hf/model.safetensors``: ``checkpoint.save_hf``; version 2; a
version 1 manifest, written before, lists the top-level files only). Each rank writes a part for the files it wrote
itself (``.manifest-<rank>.json``: DCP names them ``__<rank>_<n>.distcp``; rank 0 also takes ``.metadata``,
Lightning's file and anything else) right after its write, in the background writer for asynchronous saves, so ranks
hash in parallel and never in a training step. Rank 0 merges the parts into ``manifest.json`` (hashing any file no
part named) just before it publishes the folder.

A folder ``lightning-dist-export`` writes carries a manifest of the same form, :data:`EXPORT_MARKER`, which also marks
it as an export that ``--overwrite`` may replace.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lightning_dist.manifest import MANIFEST_VERSION, PART, describe, files_of, manifest_problem, write_json

LATEST = "latest"  #: the file naming the newest complete checkpoint of a run's checkpoint folder
MANIFEST = "manifest.json"  #: in a sharded checkpoint folder: every other file's size and CRC-32
#: In a folder ``lightning-dist-export`` wrote: its manifest, and the mark that the folder is an export (``--overwrite``
#: replaces only a folder holding it). Hidden, so a HuggingFace folder lists as transformers writes one.
EXPORT_MARKER = ".lightning-dist-export.json"
HF_FOLDER = "hf"  #: the HuggingFace weights' folder inside a checkpoint folder (``checkpoint.save_hf``)
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: one or more files per rank


# ------------------------------------------------------------------------------------------------- the folder
def complete_checkpoints(dirpath: Path) -> list[Path]:
    """The published checkpoints in ``dirpath``, oldest first (``.partial`` ones are unfinished saves)."""
    if not Path(dirpath).is_dir():
        return []
    return sorted(p for p in Path(dirpath).iterdir() if p.name.startswith("step-"))


def pointed(dirpath: Path) -> Path | None:
    """The checkpoint the ``latest`` file names, if the file is there and what it names exists."""
    pointer = Path(dirpath) / LATEST
    try:
        named = Path(dirpath) / pointer.read_text().strip()
    except OSError:
        return None
    return named if named.name.startswith("step-") and named.exists() else None


# ------------------------------------------------------------------------------------------ writing a manifest
def own_files(folder: Path, rank: int) -> list[str]:
    """The files of the checkpoint ``folder`` that ``rank`` wrote: its DCP shards; rank 0 also every other file."""
    mine = []
    for name in _checkpoint_files(Path(folder)):
        shard = _SHARD.match(name)
        if (int(shard.group(1)) == rank) if shard else rank == 0:
            mine.append(name)
    return mine


def write_part(folder: Path, rank: int) -> None:
    """This rank's part of the manifest of the checkpoint ``folder``, once its own files are written: their sizes and
    CRC-32s, in ``.manifest-<rank>.json`` (written under a temporary name and renamed, so a part is there whole)."""
    folder = Path(folder)
    write_json(folder / f".manifest-{rank}.json", describe(folder, own_files(folder, rank)))


def parts_written(folder: Path, world_size: int) -> bool:
    """Whether every rank's part of ``folder``'s manifest is there (rank 0 publishes an asynchronous save then)."""
    return all((Path(folder) / f".manifest-{rank}.json").is_file() for rank in range(world_size))


def merge_parts(folder: Path) -> None:
    """Rank 0, when every rank's part is written: one ``manifest.json`` naming every file of ``folder`` (a file no part
    named is hashed here), durable on disk before the folder is published; the parts are removed."""
    folder = Path(folder)
    files: dict[str, dict[str, Any]] = {}
    parts = [path for path in folder.iterdir() if PART.match(path.name)]
    for part in parts:
        files.update(json.loads(part.read_text()))
    files.update(describe(folder, [name for name in _checkpoint_files(folder) if name not in files]))
    write_json(
        folder / MANIFEST, {"version": MANIFEST_VERSION, "checksum": "crc32", "files": dict(sorted(files.items()))}
    )
    for part in parts:
        part.unlink()


# ----------------------------------------------------------------------------------------- checking a manifest
def has_manifest(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` has a manifest (checkpoints written before it existed have none)."""
    return (Path(folder) / MANIFEST).is_file()


def export_problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with the exported ``folder`` against its :data:`EXPORT_MARKER` (a file missing, truncated, changed
    or added), or ``None``; ``None`` too for a folder that is not an export (nothing to check it against)."""
    if not (Path(folder) / EXPORT_MARKER).is_file():
        return None
    return manifest_problem(folder, checksums, name=EXPORT_MARKER, unlisted=True)


def _checkpoint_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder its manifest lists (``hf/`` included): all but the manifest and its parts."""
    return files_of(folder, MANIFEST)
