"""What data a run reads, by content: a fingerprint of the files of ``data.path`` (and ``data.val_path``) that does not
depend on where they are. A run continuing a checkpoint compares it with the one its run noted (``config/start.py``'s
run record): the same bytes moved to a new path are the same data; new bytes at the old path are not.

Each file counts by its name relative to the data's folder, its size and a CRC-32 of its bytes: the whole file up to
:data:`WHOLE` bytes; beyond, :data:`SLICES` slices of :data:`SLICE` bytes spread over it, the first and the last
included (a bounded read per file however large; an edit that keeps the size and falls between the slices is not
seen). ``lightning-dist-prepare``'s folder is counted by the CRC-32s of its manifest (``lightning_dist/manifest.py``,
checked against the files before a run reads them). No torch.
"""

from __future__ import annotations

import glob
import hashlib
import zlib
from pathlib import Path
from typing import Any

from lightning_dist.manifest import DATA_MANIFEST, crc32_of, read_manifest

WHOLE = 64 << 20  #: files up to this size are read whole
SLICES = 16  #: slices read of a larger file
SLICE = 64 << 10  #: bytes of each slice
_GLOB_CHARS = ("*", "?", "[")


def data_contents(data: Any) -> str | None:
    """The fingerprint of the files ``data`` (a ``DataConfig``) reads, as 16 hex digits; ``None`` for data that has no
    files of its own (synthetic data, a hub stream: its id and revision are in the record already)."""
    if getattr(data, "kind", None) not in ("text", "tokens", "hf"):
        return None
    paths = [data.path] if isinstance(data.path, str) else list(data.path or [])
    if getattr(data, "val_path", None):
        paths.append(data.val_path)
    digest = hashlib.sha256()
    counted = False
    for path in paths:
        for name, value in sorted(_files_of(str(path), data.kind).items()):
            digest.update(f"{name}|{value}\n".encode())
            counted = True
    return digest.hexdigest()[:16] if counted else None


def _files_of(path: str, kind: str) -> dict[str, str]:
    """``{name relative to the data's folder: "size:crc32"}`` of the files under ``path`` (a file, folder or glob)."""
    root = Path(path).expanduser()
    if kind == "tokens" and (root / DATA_MANIFEST).is_file():
        manifest = read_manifest(root, DATA_MANIFEST) or {"files": {}}
        return {name: f"{entry['size']}:{entry['crc32']}" for name, entry in manifest["files"].items()}
    if root.is_file():
        files, base = [root], root.parent
    elif root.is_dir():
        files = [f for f in root.rglob("*") if f.is_file() and not _hidden(f.relative_to(root))]
        base = root
    elif any(c in path for c in _GLOB_CHARS):
        files = [Path(f) for f in glob.glob(str(root), recursive=True) if Path(f).is_file()]
        prefix = _fixed_prefix(str(root))
        base = Path(prefix) if prefix.endswith("/") else Path(prefix).parent
    else:
        return {}  # a hub id (data=hf streams it): named in the record as it is
    if kind == "tokens":
        files = [f for f in files if f.name in ("train.bin", "val.bin")]
    return {f.relative_to(base).as_posix() if f.is_relative_to(base) else f.name: _sample(f) for f in sorted(files)}


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)  # the manifest, a datasets cache: not the data


def _fixed_prefix(pattern: str) -> str:
    """The part of a glob before its first wildcard (the folder its matches are named relative to)."""
    cut = min((pattern.index(c) for c in _GLOB_CHARS if c in pattern), default=len(pattern))
    return pattern[:cut]


def _sample(file: Path) -> str:
    """``"size:crc32"`` of ``file``: the whole of a small file, evenly spread slices of a large one."""
    size = file.stat().st_size
    if size <= WHOLE:
        return f"{size}:{crc32_of(file)}"
    crc = 0
    with open(file, "rb") as handle:
        for i in range(SLICES):
            handle.seek(i * (size - SLICE) // (SLICES - 1))  # the first slice at 0, the last ending at the end
            crc = zlib.crc32(handle.read(SLICE), crc)
    return f"{size}:{crc:08x}"
