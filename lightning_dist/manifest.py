"""Files the project writes and reads back, each folder with a manifest: every file's size and the CRC-32 of its
bytes, written with the folder and checked before it is used (a file missing, truncated, changed or added is named).

Checkpoints (``checkpoint/folder.py``: ``manifest.json``, assembled from every rank's part), the folders
``lightning-dist-export`` writes (``checkpoint/folder.py``'s ``EXPORT_MARKER``) and tokenized data
(:data:`DATA_MANIFEST`: ``lightning-dist-prepare``'s ``OUT``, a ``data=hf`` cache) all use this one form. No torch
(the launcher checks a manifest before any rank starts). CRC-32 (``zlib.crc32``, the checksum a zip archive keeps per
member) reads about 3 GB/s from the page cache here, ~2x sha256 and ~4x blake2b (docs/failures.md): it finds any
accidental change of a file's bytes, not a forgery.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

#: In a folder of tokenized data (``lightning-dist-prepare``'s ``OUT``, a ``data=hf`` cache): its files' manifest.
DATA_MANIFEST = ".manifest.json"
MANIFEST_VERSION = 2  #: 2: the files of subfolders too (1: the top-level files only)
PART = re.compile(r"^\.manifest-(\d+)\.json$")  #: a rank's part of a checkpoint's manifest, not yet merged
_CHUNK = 8 << 20  # bytes read at a time: large enough that the checksum, not Python, sets the pace


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


def write_manifest(folder: Path, name: str, names: list[str] | None = None, **extra: Any) -> None:
    """A manifest ``name`` in ``folder`` of the files ``names`` (default: every file in it, subfolders too), with
    ``extra`` fields beside ``files`` (what wrote it, from what); flushed to disk before it is renamed into place."""
    folder = Path(folder)
    files = describe(folder, files_of(folder, name) if names is None else names)
    write_json(folder / name, {"version": MANIFEST_VERSION, "checksum": "crc32", **extra, "files": files})


def read_manifest(folder: Path, name: str = "manifest.json") -> dict[str, Any] | None:
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
def manifest_problem(
    folder: Path, checksums: bool = True, name: str = "manifest.json", under: str = "", unlisted: bool = False
) -> str | None:
    """What is wrong with the files of ``folder`` against its manifest ``name``, naming the file (a missing file,
    another size, with ``checksums`` another CRC-32), or ``None`` when every file is as it was written.

    Args:
        under: Check only the files of this subfolder (``"hf/"``): what a reader of that subfolder alone uses.
        unlisted: A file (under ``under``) that the manifest does not name is a problem too (added after it was
            written: transformers would read a stray shard).
    """
    folder = Path(folder)
    if not (folder / name).is_file():
        return f"its {name} is missing"
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
        extra = [file for file in files_of(folder, name) if file.startswith(under) and file not in files]
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


def files_of(folder: Path, skip: str) -> list[str]:
    """The files a manifest of ``folder`` lists (``/``-separated paths relative to it, subfolders included): all but
    the manifest ``skip``, the parts and temporary files."""
    names = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        where = Path(root).relative_to(folder)
        for file in files:
            if where == Path(".") and (file == skip or PART.match(file)):
                continue
            if not file.endswith(".tmp"):
                names.append((where / file).as_posix())
    return sorted(names)


def write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``: a temporary file flushed to disk, then renamed (the file is there whole)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as file:
        json.dump(value, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)
