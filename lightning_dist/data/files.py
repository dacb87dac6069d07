"""File-backed datasets: raw bytes (``text``) and nanoGPT-style token ``.bin`` files (``tokens``)."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_dist.data.blend import Blend
from lightning_dist.data.config import TOKEN_DTYPES

_GLOB_CHARS = ("*", "?", "[")


def resolve_text_files(path: str | None) -> list[Path]:
    """Resolves ``data.path`` to a sorted list of files.

    Args:
        path: A file, a directory (all files below it, recursively) or a glob.

    Returns:
        The matched files, sorted by path.

    Raises:
        ValueError: If ``path`` is None.
        FileNotFoundError: If nothing matched.
    """
    if path is None:
        raise ValueError(
            "data.path is None but data.kind='text' needs it; pass a file, directory or glob (data.path=...)"
        )
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    elif any(c in path for c in _GLOB_CHARS):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    else:
        files = []
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r} matched no file; pass an existing file, directory or glob (data=text data.path=...)"
        )
    return files


def _chunk_count(num_tokens: int, seq_len: int) -> int:
    return num_tokens // (seq_len + 1)


class TextDataset(Dataset):
    """Byte-level text: non-overlapping chunks of ``seq_len + 1`` bytes (vocabulary 256).

    All matched files are concatenated in sorted-path order; the last ``val_fraction`` of the bytes is the
    validation split, the rest the training split.
    """

    def __init__(self, path: str | None, split: str, seq_len: int, val_fraction: float = 0.1) -> None:
        """Reads the files and keeps the split's bytes in memory.

        Args:
            path: A file, a directory or a glob.
            split: "train" or "val".
            seq_len: Model sequence length.
            val_fraction: Tail fraction of the bytes used for validation.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is unknown; use 'train' or 'val'")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1); pass e.g. data.val_fraction=0.1")
        files = resolve_text_files(path)
        contents = [f.read_bytes() for f in files]
        for file, content in zip(files, contents):
            nul = content.find(b"\0")  # text has no NUL bytes; token .bin files and archives do
            if nul >= 0:
                raise ValueError(
                    f"data.path file {str(file)!r} is binary (a NUL byte at offset {nul}); data=text "
                    "reads text files: for token .bin files use data=tokens."
                )
        data = np.frombuffer(b"".join(contents), dtype=np.uint8)
        if data.size == 0:
            raise ValueError(f"data.path={path!r} holds only empty files; point data.path at non-empty text")
        num_val = round(data.size * val_fraction)
        self.data = data[data.size - num_val :] if split == "val" else data[: data.size - num_val]
        self.split = split
        self.seq_len = seq_len
        self._len = _chunk_count(self.data.size, seq_len)
        if self._len == 0:
            raise ValueError(
                f"text split {split!r} of data.path={path!r} has {self.data.size} bytes, fewer than "
                f"seq_len+1={seq_len + 1} needed for one sample; use more text, a smaller data.seq_len "
                "or a larger data.val_fraction"
            )

    def __len__(self) -> int:
        """Returns the number of samples."""
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(inputs, targets)`` int64 tensors of length ``seq_len``, targets shifted by one."""
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        n = self.seq_len + 1
        chunk = torch.from_numpy(self.data[index * n : (index + 1) * n].astype(np.int64))
        return chunk[:-1], chunk[1:]


class TokenDataset(Dataset):
    """nanoGPT-format tokens: ``<dir>/{train,val}.bin`` as a flat array, chunked into ``seq_len + 1`` tokens.

    The file is memory-mapped lazily per process (so DataLoader workers do not pickle its contents).
    Token ids are NOT checked against ``vocab_size``: scanning a multi-GB file would stall startup, so an
    out-of-range id surfaces as an embedding index error in the model instead.
    """

    def __init__(self, directory: str | None, split: str, seq_len: int, dtype: str = "uint16") -> None:
        """Validates the file and records its size.

        Args:
            directory: Directory holding ``train.bin`` and ``val.bin``.
            split: "train" or "val".
            seq_len: Model sequence length.
            dtype: Element type of the file, "uint16" or "uint32".
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is unknown; use 'train' or 'val'")
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.token_dtype={dtype!r} is unsupported; use one of {', '.join(TOKEN_DTYPES)}")
        if directory is None:
            raise ValueError(
                "data.path is None but data.kind='tokens' needs it; pass a directory with train.bin and val.bin"
            )
        d = Path(directory).expanduser()
        if not d.is_dir():
            raise FileNotFoundError(
                f"data.path={directory!r} is not a directory; pass a directory holding train.bin and val.bin"
            )
        self.file = d / f"{split}.bin"
        if not self.file.is_file():
            raise FileNotFoundError(
                f"{str(self.file)!r} does not exist; data.path={directory!r} must hold train.bin and val.bin"
            )
        self.dtype = np.dtype(dtype)
        size = self.file.stat().st_size
        if size == 0:
            raise ValueError(f"{str(self.file)!r} is empty; data.path={directory!r} must hold train.bin and val.bin")
        if size % self.dtype.itemsize:
            raise ValueError(f"{str(self.file)!r} has {size} bytes, not a multiple of {dtype}; check data.token_dtype")
        self.num_tokens = size // self.dtype.itemsize
        self.split = split
        self.seq_len = seq_len
        # A mixture lightning-dist-prepare wrote with --weights: each window of the blend, where it starts in the file.
        self._starts = blend_starts(d, split, seq_len, self.num_tokens)
        self._len = len(self._starts) if self._starts is not None else _chunk_count(self.num_tokens, seq_len)
        if self._len == 0:
            raise ValueError(
                f"{str(self.file)!r} has {self.num_tokens} tokens, fewer than seq_len+1={seq_len + 1} needed for "
                "one sample; use a larger file or a smaller data.seq_len"
            )
        self._data: np.memmap | None = None

    def max_token(self) -> int:
        """The largest token id in the file (read in chunks: memory stays small for any size)."""
        data = np.memmap(self.file, dtype=self.dtype, mode="r")
        chunk = 1 << 26
        return int(max(data[start : start + chunk].max() for start in range(0, data.size, chunk)))

    def __getstate__(self) -> dict[str, Any]:
        # Drop the mapping so pickling to workers stays cheap; each process re-maps on first access.
        state = self.__dict__.copy()
        state["_data"] = None
        return state

    def __len__(self) -> int:
        """Returns the number of samples."""
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(inputs, targets)`` int64 tensors of length ``seq_len``, targets shifted by one."""
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        if self._data is None:
            self._data = np.memmap(self.file, dtype=self.dtype, mode="r")
        n = self.seq_len + 1
        start = index * n if self._starts is None else int(self._starts[index])
        chunk = torch.from_numpy(self._data[start : start + n].astype(np.int64))
        return chunk[:-1], chunk[1:]


def blend_starts(directory: Path, split: str, seq_len: int, num_tokens: int) -> np.ndarray | None:
    """Where each window of a mixture's ``train.bin`` starts, or None for a plain file (no ``blend`` in its
    ``meta.json``: windows one after the other).

    ``lightning-dist-prepare --weights`` writes each source's tokens once, one after the other, and the blend in
    ``meta.json``: the sources' integer shares and the mixture's tokens. Each source is cut into windows of
    ``seq_len + 1`` tokens on its own; the mixture's ``train_tokens // (seq_len + 1)`` windows come from the sources by
    the blend's index (:class:`~lightning_dist.data.blend.Blend`: source j gives ``share_j / sum`` of them, to under
    one window), and the ``c_j`` windows a source gives are spread evenly over its own ``w_j``: the k-th is its window
    ``k * w_j // c_j`` (fewer than it has: about every ``w_j / c_j``-th, each at most once; more: each
    ``floor(c_j / w_j)`` or ``ceil(c_j / w_j)`` times).

    Raises:
        ValueError: ``meta.json`` does not describe the file, or a source holds less than one window (one line).
    """
    meta_file = directory / "meta.json"
    if split != "train" or not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    blend, sources = meta.get("blend"), meta.get("sources", [])
    if not blend:
        return None
    if not sources or sources[-1]["offset"] + sources[-1]["train_tokens"] != num_tokens:
        raise ValueError(
            f"{str(directory / 'train.bin')!r} holds {num_tokens} tokens, not those its meta.json describes; write the "
            "folder again with lightning-dist-prepare"
        )
    n = seq_len + 1
    windows = np.array([source["train_tokens"] // n for source in sources], dtype=np.int64)
    for source, count in zip(sources, windows):
        if count == 0:
            raise ValueError(
                f"data.path={str(directory)!r}: source {source['source']} has {source['train_tokens']} train tokens, "
                f"fewer than one window of data.seq_len+1={n}; lower data.seq_len, or prepare more of that source"
            )
    source, position = Blend(blend["shares"], "meta.json blend").index(blend["train_tokens"] // n)
    counts = np.bincount(source, minlength=len(sources))
    offsets = np.array([s["offset"] for s in sources], dtype=np.int64)
    return offsets[source] + (position * windows[source] // counts[source]) * n
