"""data=hf, packing and the cache: the token sequences cut into windows, written once as memory-mapped ``.npy`` files.

**Packing.** The documents (or records) are concatenated in file order, each ended by EOS, and cut into windows of
``seq_len + 1`` tokens (inputs = ``[:-1]``, targets = ``[1:]``, as for ``data=text`` and ``data=tokens``); the last
partial window is dropped. Attention crosses the document boundaries inside a window (no per-document mask): the
built-in GPT and the HF path take no attention mask, and packing with EOS separators is what nanoGPT and torchtitan
do. The model sees the EOS before a new document, and no token is spent on padding. Instruction and chat records are
packed the same way, every token carrying whether it is a target of the loss (the response and the EOS after it):
other targets are ``-100``, which the loss ignores, and a window holding no target at all is skipped (its loss would
be 0 / 0).

**The cache**: ``<data.cache_dir>/<key>/`` holds ``tokens.npy`` (windows x (seq_len + 1) token ids, uint16 or
uint32), ``mask.npy`` (the same shape, 1 = a target; instruction and chat only), ``windows.npy`` (the windows used)
and ``meta.json``. The key is the sha256 of the tokenizer files' content, the source files' paths, sizes and
modification times, ``seq_len``, the format and its fields, and :data:`CACHE_VERSION`; ``data.val_fraction`` is not
in it (the split is taken when the cache is opened). A cache is built in a temporary folder next to it and renamed
into place, so a killed run or builders racing each other never leave half of one: the first rename wins, the others
are thrown away. The app builds it once, before its ranks start (the validation pass); with a library user's own
``Trainer``, Lightning's ``prepare_data`` builds it once per node; the ranks only map the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_dist.data import corpus
from lightning_dist.manifest import DATA_MANIFEST, write_manifest

#: Bumped when what a cache folder holds changes, so older caches are never read as newer ones (2: a manifest of its
#: files, checked before a run reads them: ``lightning_dist/manifest.py``).
CACHE_VERSION = 2
#: The target of a token without loss (the default ``ignore_index`` of ``F.cross_entropy``).
IGNORE_INDEX = -100
_ROWS = 1 << 16  # windows scanned at a time when finding the windows with a target


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_dist/data`` (``~/.cache/lightning_dist/data``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_dist" / "data"


def cache_key(cfg: Any, files: list[Path], tokenizer: str) -> str:
    """The sha256 naming the cache of ``files`` tokenized by the folder ``tokenizer`` under ``cfg``."""
    stats = [(f, f.stat()) for f in (file.resolve() for file in files)]
    parts = {
        "version": CACHE_VERSION,
        "tokenizer": [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in corpus.tokenizer_files(tokenizer)],
        "files": [(str(f), st.st_size, st.st_mtime_ns) for f, st in stats],
        "seq_len": int(cfg.seq_len),
        "format": cfg.format,
        "fields": corpus.record_fields(cfg),
        "sample_by": cfg.sample_by,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def build_cache(cfg: Any, where: str = "data.path") -> Path:
    """The cache folder of the corpus named by the config field ``where`` (``data.path`` or ``data.val_path``),
    tokenized and written first if it is not there yet."""
    path = cfg.path if where == "data.path" else cfg.val_path
    if cfg.tokenizer is None:
        raise ValueError(
            "data.tokenizer=null; pass the folder of the model's tokenizer (data.tokenizer=...; the app defaults it "
            "to the model's own folder when it has one)"
        )
    files = corpus.corpus_files(path, where)
    key = cache_key(cfg, files, cfg.tokenizer)
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    final = root / key[:32]
    if (final / "meta.json").is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:32]}-", dir=root))
    except OSError as err:
        raise ValueError(
            f"data.cache_dir={str(root)!r} cannot be written ({err.strerror}); point data.cache_dir at a folder you "
            "can write"
        ) from None
    try:
        _write(cfg, files, where, path, work, key)
        try:
            os.rename(work, final)  # atomic: the folder appears whole or not at all
        except OSError:
            if not (final / "meta.json").is_file():  # not a concurrent builder that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _write(cfg: Any, files: list[Path], where: str, path: str, work: Path, key: str) -> None:
    tokenizer = corpus.load_tokenizer(cfg.tokenizer)
    records = corpus.load_records(files, cfg, work / "datasets", where)
    encoded = corpus.tokenize(records, tokenizer, cfg, fingerprint=f"lightning-dist-{key[:16]}")
    length = cfg.seq_len + 1
    ids = encoded.data.column("ids")
    total = sum(len(chunk.flatten()) for chunk in ids.chunks)
    count = total // length
    if count == 0:
        raise ValueError(
            f"{where}={path!r} holds {total} tokens, fewer than one window of data.seq_len+1={length}; add text or "
            "lower data.seq_len"
        )
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    _fill(work / "tokens.npy", ids, dtype, count, length)
    masked = cfg.format != "text"
    if masked:
        mask = _fill(work / "mask.npy", encoded.data.column("mask"), np.uint8, count, length)
        windows = np.concatenate(
            [start + np.flatnonzero(mask[start : start + _ROWS, 1:].any(axis=1)) for start in range(0, count, _ROWS)]
        )
        del mask
        if windows.size == 0:
            raise ValueError(
                f"no window of {where}={path!r} holds a response token, so there is nothing to learn; check "
                f"data.format={cfg.format} and the records"
            )
    else:
        windows = np.arange(count)
    np.save(work / "windows.npy", windows.astype(np.int64))
    meta = {
        "version": CACHE_VERSION,
        "key": key,
        "seq_len": int(cfg.seq_len),
        "windows": int(windows.size),
        "tokens": int(total),
        "vocab_size": vocab,
        "eos_token_id": int(tokenizer.eos_token_id),
        "masked": masked,
        "format": cfg.format,
        "tokenizer": str(Path(cfg.tokenizer).expanduser().resolve()),
        "source": f"{where}={path}",
        "num_files": len(files),
    }
    del records, encoded, ids
    shutil.rmtree(work / "datasets", ignore_errors=True)  # the datasets library's Arrow copies: no longer needed
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(work, DATA_MANIFEST)  # each file's size and CRC-32, checked before a run reads the cache
    work.chmod(0o755)  # mkdtemp made it private; a shared cache is read by every user's ranks


def _fill(file: Path, column: Any, dtype: Any, count: int, length: int) -> np.ndarray:
    """Writes the first ``count x length`` values of the list column ``column`` (in order) as a ``.npy`` memmap."""
    out = np.lib.format.open_memmap(file, mode="w+", dtype=dtype, shape=(count, length))
    flat, position, end = out.reshape(-1), 0, count * length
    for chunk in column.chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        take = min(len(values), end - position)
        flat[position : position + take] = values[:take]
        position += take
        if position == end:
            break
    out.flush()
    return out


def hf_datasets(cfg: Any) -> dict[str, PackedDataset]:
    """The train and val windows of ``data=hf``: the tail ``data.val_fraction`` of the windows is val, or all of
    ``data.val_path``'s. Builds the caches that are missing."""
    train = build_cache(cfg, "data.path")
    windows = np.load(train / "windows.npy")
    if cfg.val_path is not None:
        val = build_cache(cfg, "data.val_path")
        return {"train": PackedDataset(train, windows), "val": PackedDataset(val, np.load(val / "windows.npy"))}
    num_val = max(1, round(windows.size * cfg.val_fraction))
    if windows.size - num_val < 1:
        raise ValueError(
            f"data.path={cfg.path!r} gives {windows.size} window(s) of data.seq_len+1={cfg.seq_len + 1} tokens, too "
            f"few for a train and a val split (data.val_fraction={cfg.val_fraction}); add text, lower data.seq_len or "
            "pass data.val_path"
        )
    cut = windows.size - num_val
    return {"train": PackedDataset(train, windows[:cut]), "val": PackedDataset(train, windows[cut:])}


class PackedDataset(Dataset):
    """Windows of a cache folder as ``(inputs, targets)`` int64 tensors of ``seq_len`` tokens, targets shifted by one
    and ``-100`` where there is no loss. The files are mapped lazily in each process (workers pickle no data).

    Indexed by ``(index, samples, tokens)`` (what the samplers of ``token_norm.py`` yield for masked data), a window is
    ``(inputs, targets, norm)``: ``norm`` the int64 pair ``(samples, tokens)`` of the global batch it belongs to (its
    samples and their target tokens), from which the loss takes its token-exact scale (``models/loss.py``).
    """

    def __init__(self, folder: Path, windows: np.ndarray) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.folder = folder
        self.windows = np.asarray(windows, dtype=np.int64)
        self.seq_len = int(meta["seq_len"])
        self.vocab_size = int(meta["vocab_size"])
        self.masked = bool(meta["masked"])
        self._tokens: np.ndarray | None = None
        self._mask: np.ndarray | None = None
        self._counts: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = state["_mask"] = state["_counts"] = None
        return state

    def __len__(self) -> int:
        return int(self.windows.size)

    def target_counts(self) -> np.ndarray | None:
        """The number of loss targets (not ``-100``) of each sample, in index order; ``None`` without a mask (every
        target counts). Read from ``mask.npy`` once, about 64 MiB of it at a time."""
        if not self.masked:
            return None
        if self._counts is None:
            mask = np.load(self.folder / "mask.npy", mmap_mode="r")
            rows = max(1, (64 << 20) // mask.shape[1])
            chunks = [
                mask[self.windows[start : start + rows], 1:].sum(axis=1, dtype=np.int64)
                for start in range(0, len(self), rows)
            ]
            self._counts = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return self._counts

    def __getitem__(self, item: int | tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        index = item[0] if isinstance(item, tuple) else item
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        if self._tokens is None:
            self._tokens = np.load(self.folder / "tokens.npy", mmap_mode="r")
            self._mask = np.load(self.folder / "mask.npy", mmap_mode="r") if self.masked else None
        window = int(self.windows[index])
        row = torch.from_numpy(self._tokens[window].astype(np.int64))
        targets = row[1:].clone()
        if self._mask is not None:
            targets[torch.from_numpy(self._mask[window, 1:] == 0)] = IGNORE_INDEX
        if isinstance(item, tuple):
            return row[:-1], targets, torch.tensor(item[1:], dtype=torch.int64)
        return row[:-1], targets
