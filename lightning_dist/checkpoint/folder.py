"""A run's checkpoint folder as files: the published checkpoints, the ``latest`` pointer, and each checkpoint's
manifest (every file's size and CRC-32), written when it is published and checked before it is loaded or exported.

No torch here: the launcher finds a run's checkpoints and checks a manifest without it (``tests/unit/test_layering.py``,
``test_startup_imports.py``).

**The manifest** (``manifest.json`` in a sharded checkpoint folder) names every file of the folder with its size and
the CRC-32 of its bytes, those in its subfolders too (``hf/model.safetensors``: ``checkpoint.save_hf``; version 2; a
version 1 manifest, written before, lists the top-level files only). Each rank writes a part for the files it wrote
itself (``.manifest-<rank>.json``: DCP names them ``__<rank>_<n>.distcp``; rank 0 also takes ``.metadata``,
Lightning's file and anything else) right after its write, in the background writer for asynchronous saves, so ranks
hash in parallel and never in a training step. Rank 0
merges the parts into ``manifest.json`` (hashing any file no part named) just before it publishes the folder. CRC-32
(``zlib.crc32``, the checksum a zip archive keeps per member) reads about 3 GB/s from the page cache here, ~2x
sha256 and ~4x blake2b (docs/failures.md): it finds any accidental change of a file's bytes, not a forgery.

**Other folders the project reads back** carry a manifest of the same form under a name of their own:
``lightning-dist-export``'s folders (:data:`EXPORT_MARKER`, which also marks the folder as an export that
``--overwrite`` may replace) and tokenized data (``lightning-dist-prepare``'s ``OUT``, ``data=hf``'s cache:
:data:`DATA_MANIFEST`). :func:`write_manifest` writes one, :func:`manifest_problem` checks one.
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
#: In a folder ``lightning-dist-export`` wrote: its manifest, and the mark that the folder is an export (``--overwrite``
#: replaces only a folder holding it). Hidden, so a HuggingFace folder lists as transformers writes one.
EXPORT_MARKER = ".lightning-dist-export.json"
#: In a folder of tokenized data (``lightning-dist-prepare``'s ``OUT``, a ``data=hf`` cache): its files' manifest.
DATA_MANIFEST = ".manifest.json"
HF_FOLDER = "hf"  #: the HuggingFace weights' folder inside a checkpoint folder (``checkpoint.save_hf``)
MANIFEST_VERSION = 2  #: 2: the files of subfolders too (1: the top-level files only)
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
    _write_json(
        folder / MANIFEST, {"version": MANIFEST_VERSION, "checksum": "crc32", "files": dict(sorted(files.items()))}
    )
    for part in parts:
        part.unlink()


def write_manifest(folder: Path, name: str, **extra: Any) -> None:
    """A manifest ``name`` in ``folder`` of every file in it (subfolders too), with ``extra`` fields beside
    ``files`` (what wrote it, from what); flushed to disk before it is renamed into place."""
    folder = Path(folder)
    files = describe(folder, _data_files(folder, skip=name))
    _write_json(folder / name, {"version": MANIFEST_VERSION, "checksum": "crc32", **extra, "files": files})


def read_manifest(folder: Path, name: str = MANIFEST) -> dict[str, Any] | None:
    """The manifest ``name`` of ``folder``; ``None`` when there is none or it cannot be read as one."""
    try:
        manifest = json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def make_readable(path: Path) -> None:
    """Give the files under ``path`` (a file or a folder) the permissions a new file of this process gets (its
    umask's: ``0644`` under the usual ``022``): safetensors (0.8) writes through a private temporary file (``0600``),
    so an export or a checkpoint's ``hf/`` another user (a serving job, a colleague) reads would be closed to them."""
    path = Path(path)
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it while reading: a file another thread
    creates meanwhile would get the wrong permissions)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------------------- checking a manifest
def has_manifest(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` has a manifest (checkpoints written before it existed have none)."""
    return (Path(folder) / MANIFEST).is_file()


def manifest_problem(
    folder: Path, checksums: bool = True, name: str = MANIFEST, under: str = "", unlisted: bool = False
) -> str | None:
    """What is wrong with the files of ``folder`` against its manifest ``name``, naming the file (a missing file,
    another size, with ``checksums`` another CRC-32), or ``None`` when every file is as it was written.

    Args:
        under: Check only the files of this subfolder (``"hf/"``): what a reader of that subfolder alone uses.
        unlisted: A file (under ``under``) that the manifest does not name is a problem too (added after it was
            written: transformers would read a stray shard).
    """
    folder = Path(folder)
    try:
        files = json.loads((folder / name).read_text())["files"]
        files = {key: value for key, value in files.items() if key.startswith(under)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {name} cannot be read (truncated?)"
    for file, written in files.items():  # sizes first: a truncated or missing file is found without reading any
        try:
            size = (folder / file).stat().st_size
        except OSError:
            return f"{file} is missing"
        if size != written["size"]:
            return f"{file} has {size} bytes, not the {written['size']} written (truncated?)"
    if unlisted:
        extra = [file for file in _data_files(folder, skip=name) if file.startswith(under) and file not in files]
        if extra:
            return f"{extra[0]} is not in its {name} (added after it was written)"
    if checksums:
        for file, written in files.items():
            try:
                crc = crc32_of(folder / file)
            except OSError as err:
                return f"{file} cannot be read ({err.strerror})"
            if crc != written["crc32"]:
                return f"{file} does not match the CRC-32 written with it (its bytes changed)"
    return None


def export_problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with the exported ``folder`` against its :data:`EXPORT_MARKER` (a file missing, truncated, changed
    or added), or ``None``; ``None`` too for a folder that is not an export (nothing to check it against)."""
    if not (Path(folder) / EXPORT_MARKER).is_file():
        return None
    return manifest_problem(folder, checksums, name=EXPORT_MARKER, unlisted=True)


def _data_files(folder: Path, skip: str = MANIFEST) -> list[str]:
    """The files a manifest of ``folder`` lists (``/``-separated paths relative to it, subfolders included): all but
    the manifest ``skip``, the parts and temporary files."""
    names = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        where = Path(root).relative_to(folder)
        for file in files:
            if where == Path(".") and (file == skip or _PART.match(file)):
                continue
            if not file.endswith(".tmp"):
                names.append((where / file).as_posix())
    return sorted(names)


def _write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``: a temporary file flushed to disk, then renamed (the file is there whole)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as file:
        json.dump(value, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)
