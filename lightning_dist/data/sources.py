"""A corpus source as ``lightning-dist-prepare`` and ``data.path`` name it, and its records read with datasets.

A source is ``LOCATION[?OPTIONS]``: ``LOCATION`` is a local file, folder or glob of ``.txt`` / ``.jsonl`` / ``.json``
/ ``.parquet`` files, a hub dataset id ``org/name[@revision]``, or a hub dataset pinned for streaming
(``hf://datasets/org/name@<commit>``); ``OPTIONS`` are ``key=value`` pairs joined by ``&`` (quote the source in a
shell: ``?`` and ``&`` are special there):

- ``name``: the dataset's configuration (datasets' ``name``: a hub dataset's subset, e.g. ``sample-10BT`` of
  ``HuggingFaceFW/fineweb-edu``); hub only.
- ``split``: the split to read (default ``train``); hub only.
- ``data_files``: a glob of the repo's files to read (repeat it for several); hub only.
- ``max_tokens``: at most this many tokens of the source (``lightning-dist-prepare``; ``2e9``, ``2B``, ``500M`` and
  ``1_000_000`` are read): its documents are read, streamed, only until then.

So ``HuggingFaceFW/fineweb-edu?name=sample-10BT&max_tokens=2B`` reads the first 2 billion tokens of that subset,
fetching its parquet files by HTTP range requests only as far as that. Everything is read through datasets'
``load_dataset`` (local files by their suffix's builder, hub datasets by id, with ``HF_TOKEN`` / ``HF_ENDPOINT``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from lightning_dist.data import corpus
from lightning_dist.hub import HUB_STREAM, SOURCE_OPTIONS, looks_like_hub_id, split_source

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Source:
    """One source of a corpus (module docstring)."""

    text: str
    """As the user wrote it (for messages)."""
    location: str
    """A local path or glob, a hub id ``org/name[@revision]``, or ``hf://datasets/org/name[@commit]``."""
    name: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] = ()
    max_tokens: int | None = None

    @property
    def hub(self) -> tuple[str, str | None] | None:
        """``(repo id, revision or None)`` for a hub dataset not on this machine, else None (local files)."""
        if self.location.startswith(HUB_STREAM):
            repo_id, _, revision = self.location[len(HUB_STREAM) :].strip("/").partition("@")
            return repo_id, revision or None
        if not Path(self.location).expanduser().exists() and looks_like_hub_id(self.location):
            repo_id, _, revision = self.location.partition("@")
            return repo_id, revision or None
        return None

    @property
    def selects(self) -> bool:
        """Whether it names a part of a hub dataset (a config, a split, files)."""
        return self.name is not None or self.split != "train" or bool(self.data_files)


def parse_source(text: str, where: str = "SOURCE") -> Source:
    """``text`` as a :class:`Source`.

    Raises:
        ValueError: An unknown or repeated option, a ``max_tokens`` that is not a positive count, or a hub-only option
            on local files (one line naming ``where``).
    """
    location, options = split_source(str(text))
    fields: dict[str, Any] = {}
    for key, values in parse_qs(options, keep_blank_values=True, strict_parsing=bool(options)).items():
        if key not in SOURCE_OPTIONS:
            raise ValueError(f"{where}={text}: unknown option {key!r}; use {', '.join(SOURCE_OPTIONS)}")
        if key != "data_files" and len(values) > 1:
            raise ValueError(f"{where}={text}: {key} is given {len(values)} times; give it once")
        if key == "data_files":
            fields[key] = tuple(values)
        elif key == "max_tokens":
            fields[key] = _count(values[0], f"{where}={text}")
        else:
            fields[key] = values[0]
    source = Source(text=str(text), location=location, **fields)
    if location.startswith(HUB_STREAM) and source.hub is not None and source.hub[0].count("/") != 1:
        raise ValueError(f"{where}={text}: a hub dataset is hf://datasets/<org>/<name>[@<revision>]")
    if source.selects and source.hub is None:
        raise ValueError(
            f"{where}={text}: name, split and data_files select a part of a hub dataset, and {location} is local; "
            "point the location at the files you want (a glob), or give a hub dataset id"
        )
    return source


def _count(value: str, where: str) -> int:
    found = _NUMBER.match(value)
    number = float(found.group(1).replace("_", "")) * _SUFFIXES[found.group(2).upper()] if found else 0.0
    if number < 1 or number != int(number):
        raise ValueError(f"{where}: max_tokens={value!r} is not a positive count of tokens; e.g. max_tokens=2e9 or 2B")
    return int(number)


def open_source(source: Source, sample_by: str, streaming: bool, where: str = "SOURCE") -> Any:
    """The records of ``source`` as datasets reads them: an ``IterableDataset`` (``streaming``: nothing downloaded
    whole) or a ``Dataset`` (a hub source's selected files downloaded into datasets' cache); ``.txt`` files give one
    record per ``sample_by``.

    Raises:
        ValueError: No such local files, or the hub dataset cannot be read (one line).
    """
    import datasets  # optional dependency: lightning-dist[hf]

    hub = source.hub
    if hub is None:
        files = corpus.corpus_files(source.location, where)
        loader = corpus.SUFFIXES[files[0].suffix.lower()]
        kwargs = {"sample_by": sample_by} if loader == "text" else {}
        return datasets.load_dataset(
            loader, data_files=[str(f) for f in files], split="train", streaming=streaming, **kwargs
        )
    repo_id, revision = hub
    kwargs = {"name": source.name, "revision": revision, "split": source.split, "streaming": streaming}
    if source.data_files:
        kwargs["data_files"] = list(source.data_files)
    try:
        records = datasets.load_dataset(repo_id, **kwargs)
        if records.info.builder_name == "text" and sample_by != "line":  # .txt files: one record per sample_by
            records = datasets.load_dataset(repo_id, sample_by=sample_by, **kwargs)
    except (OSError, ValueError, FileNotFoundError) as err:  # DatasetNotFoundError, HfHubHTTPError are OSErrors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{where}={source.text}: reading it from the hub failed ({reason}); check the id, its config, split and "
            "data_files, its revision and your access (HF_TOKEN), or give a local folder."
        ) from None
    return records
