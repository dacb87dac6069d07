"""A run's checkpoint folder as files: the published checkpoints, the ``latest`` pointer, and each checkpoint's
manifest (every file's size and CRC-32), written when it is published and checked before it is loaded or exported.

No torch here: the launcher finds a run's checkpoints and checks a manifest without it (``tests/unit/test_layering.py``,
``test_startup_imports.py``).

**The manifest** (``manifest.json`` in a sharded checkpoint folder) names every file of the folder with its size and
the CRC-32 of its bytes. Each rank writes a part for the files it wrote itself (``.manifest-<rank>.json``: DCP names
them ``__<rank>_<n>.distcp``; rank 0 also takes ``.metadata``, Lightning's file and anything else) right after its
write, in the background writer for asynchronous saves, so ranks hash in parallel and never in a training step. Rank 0
merges the parts into ``manifest.json`` (hashing any file no part named) just before it publishes the folder. CRC-32
(``zlib.crc32``, the checksum a zip archive keeps per member) reads about 3 GB/s from the page cache here, ~2x
sha256 and ~4x blake2b (docs/failures.md): it finds any accidental change of a file's bytes, not a forgery.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

LATEST = "latest"  #: the file naming the newest complete checkpoint of a run's checkpoint folder
MANIFEST = "manifest.json"  #: in a sharded checkpoint folder: every other file's size and CRC-32
_PART = re.compile(r"^\.manifest-(\d+)\.json$")
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: one or more files per rank
_CHUNK = 8 << 20  # bytes read at a time: large enough that the checksum, not Python, sets the pace


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
def crc32_of(path: Path) -> str:
    """The CRC-32 of the file ``path``'s bytes, read in 8 MiB chunks (``zlib.crc32`` releases the GIL), as hex."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def describe(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "crc32": hex}}`` of the files ``names`` in ``folder``."""
    return {name: {"size": (folder / name).stat().st_size, "crc32": crc32_of(folder / name)} for name in names}


def own_files(folder: Path, rank: int) -> list[str]:
    """The files of the checkpoint ``folder`` that ``rank`` wrote: its DCP shards; rank 0 also every other file."""
    mine = []
    for name in _data_files(Path(folder)):
        shard = _SHARD.match(name)
        if (int(shard.group(1)) == rank) if shard else rank == 0:
            mine.append(name)
    return mine


def write_part(folder: Path, rank: int) -> None:
    """This rank's part of the manifest of the checkpoint ``folder``, once its own files are written: their sizes and
    CRC-32s, in ``.manifest-<rank>.json`` (written under a temporary name and renamed, so a part is there whole)."""
    folder = Path(folder)
    _write_json(folder / f".manifest-{rank}.json", describe(folder, own_files(folder, rank)))


def parts_written(folder: Path, world_size: int) -> bool:
    """Whether every rank's part of ``folder``'s manifest is there (rank 0 publishes an asynchronous save then)."""
    return all((Path(folder) / f".manifest-{rank}.json").is_file() for rank in range(world_size))


def merge_parts(folder: Path) -> None:
    """Rank 0, when every rank's part is written: one ``manifest.json`` naming every file of ``folder`` (a file no part
    named is hashed here), durable on disk before the folder is published; the parts are removed."""
    folder = Path(folder)
    files: dict[str, dict[str, Any]] = {}
    parts = [path for path in folder.iterdir() if _PART.match(path.name)]
    for part in parts:
        files.update(json.loads(part.read_text()))
    files.update(describe(folder, [name for name in _data_files(folder) if name not in files]))
    _write_json(folder / MANIFEST, {"version": 1, "checksum": "crc32", "files": dict(sorted(files.items()))})
    for part in parts:
        part.unlink()


# ----------------------------------------------------------------------------------------- checking a manifest
def has_manifest(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` has a manifest (checkpoints written before it existed have none)."""
    return (Path(folder) / MANIFEST).is_file()


def manifest_problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with the files of the checkpoint ``folder`` against its manifest, naming the file (a missing
    file, another size, with ``checksums`` another CRC-32), or ``None`` when every file is as it was written."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} cannot be read (truncated?)"
    for name, written in files.items():  # sizes first: a truncated or missing file is found without reading any
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != written["size"]:
            return f"{name} has {size} bytes, not the {written['size']} written (truncated?)"
    if checksums:
        for name, written in files.items():
            try:
                crc = crc32_of(folder / name)
            except OSError as err:
                return f"{name} cannot be read ({err.strerror})"
            if crc != written["crc32"]:
                return f"{name} does not match the CRC-32 written with it (its bytes changed)"
    return None


def _data_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder a manifest lists: all but the manifest, its parts and temporary files."""
    names = (path.name for path in folder.iterdir() if path.is_file())
    return sorted(n for n in names if n != MANIFEST and not _PART.match(n) and not n.endswith(".tmp"))


def _write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``: a temporary file flushed to disk, then renamed (the file is there whole)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as file:
        json.dump(value, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)
