"""A streamed corpus for corpora larger than disk: a weighted mixture of sources read as they are needed, tokenized and
packed on the fly, with a position that a resume continues from exactly.

The sources are datasets' streaming ``IterableDataset`` s (``load_dataset(..., streaming=True)``: local files or a hub
dataset, never downloaded whole), mixed by ``interleave_datasets`` with the given probabilities and seed (every source
read until all are exhausted, the shorter ones started again). That is one pass; the stream has no end: the next pass
reads the mixture again from its start, in the same order (the tokens not yet packed carry over), so the run ends at
``trainer.max_steps``, and a position in a later pass resumes as exactly as one in the first. Each record is
tokenized by ``data=hf``'s batched function (EOS after each document) and the tokens packed into windows of
``seq_len + 1`` as ``data=hf`` packs them.

**Ranks**: every data-parallel rank reads the whole stream and keeps the windows whose index is its rank modulo their
number (as ``DistributedSampler`` deals an epoch), so the global batch of step ``k`` (windows ``kG .. kG+G-1``) is
the one-process batch under every layout; not ``split_dataset_by_node``, which gives each rank other records and so
another curve. The price: each rank tokenizes the whole stream.

**The position** is global, the same on every rank: :meth:`StreamedWindows.state_dict` says which window is next and
holds datasets' own state of the mixture (which record of which source is next, and its random generator) plus the
tokens read but not yet packed; :meth:`~StreamedWindows.load_state_dict` on a new instance, of any rank and world
size, makes it continue from that window exactly. :meth:`~StreamedWindows.state_at` gives the state before a given
window among the last few boundaries passed (a loader reads ahead of training: a checkpoint wants the state before
the first window not yet trained on). No distributed code here; the caller gives the rank and world size.

``data=hf data.streaming=true`` (:mod:`lightning_dist.data.datamodule`) serves it, and checkpoints ``state_at`` the
windows training has consumed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_dist.data import corpus
from lightning_dist.data.config import hub_stream_id, sources

log = logging.getLogger(__name__)


def streamed_mixture(
    files: Sequence[Sequence[str] | str], weights: Sequence[float] | None, seed: int, sample_by: str = "document"
) -> Any:
    """datasets' streaming mixture of ``files`` (one list of files per source, or a hub dataset streamed as
    ``hf://datasets/<org/name>[@<revision>]``), drawn with ``weights`` (normalized); ``.txt`` files give one record
    per ``sample_by`` (``data.sample_by``)."""
    import datasets  # optional dependency: lightning-dist[hf]

    sources = []
    for group in files:
        hub = hub_stream_id(group) if isinstance(group, str) else None
        if hub is not None:
            sources.append(_hub_source(group, *hub, sample_by))
            continue
        loader = corpus.SUFFIXES[Path(group[0]).suffix.lower()]
        kwargs = {"sample_by": sample_by} if loader == "text" else {}
        sources.append(
            datasets.load_dataset(loader, data_files=list(map(str, group)), split="train", streaming=True, **kwargs)
        )
    if len(sources) == 1:
        return sources[0]
    if weights is not None and (len(weights) != len(sources) or any(w <= 0 for w in weights)):
        raise ValueError(f"data.weights={list(weights)}: give one positive weight per source ({len(sources)} sources).")
    probabilities = None if weights is None else [w / sum(weights) for w in weights]
    return datasets.interleave_datasets(
        sources, probabilities=probabilities, seed=seed, stopping_strategy="all_exhausted"
    )


class StreamedWindows(IterableDataset):
    """``(inputs, targets)`` windows of ``seq_len`` tokens from a streamed corpus, this rank's share, resumable.

    Args:
        stream: A datasets streaming ``IterableDataset`` of records (:func:`streamed_mixture`).
        tokenizer: The tokenizer (``corpus.load_tokenizer``).
        data: The data config (its ``format`` must be ``text``; ``text_field``, ``seq_len``).
        rank: This data-parallel rank; ``world_size``: how many there are.
        kept: How many of the last boundaries' states :meth:`state_at` can give (more than the loader reads ahead).
    """

    #: Boundaries (windows that are multiples of the world size) whose states are kept for :meth:`state_at`.
    KEPT = 64

    def __init__(
        self, stream: Any, tokenizer: Any, data: Any, rank: int = 0, world_size: int = 1, kept: int = KEPT
    ) -> None:
        if data.format != "text":
            raise ValueError(f"data.streaming reads data.format=text; data.format={data.format} is cached only.")
        if not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} is outside [0, {world_size}); check the strategy's sizes")
        self.stream, self.rank, self.world_size, self.kept = stream, rank, world_size, kept
        self.tokenize = corpus.Tokenize(tokenizer, data)
        self.field = data.text_field
        self.length = data.seq_len + 1
        self._buffer: list[int] = []
        self._stream_state: dict[str, Any] | None = None
        self._window = 0  # the global index of the next window
        self._pass = 0  # the pass over the sources the next record is read in (0: the first)
        self._states: dict[int, dict[str, Any]] = {}
        self._start = copy.deepcopy(stream.state_dict())  # where a new pass over the sources starts

    def state_dict(self) -> dict[str, Any]:
        """The position now: the next window's global index, the pass over the sources (0 first), the mixture's state,
        the tokens not yet packed."""
        stream = self._stream_state or self.stream.state_dict()
        return {
            "window": self._window,
            "pass": self._pass,
            "stream": copy.deepcopy(stream),
            "buffer": list(self._buffer),
        }

    def state_at(self, window: int) -> dict[str, Any]:
        """The state before global window ``window`` (a multiple of the world size among the last ``kept``)."""
        if window not in self._states:
            raise ValueError(f"the stream's state before window {window} is not kept (kept: {sorted(self._states)}).")
        return copy.deepcopy(self._states[window])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of an instance over the same sources and seed, any rank)."""
        self.stream.load_state_dict(copy.deepcopy(state["stream"]))
        self._stream_state = copy.deepcopy(state["stream"])
        self._buffer = list(state["buffer"])
        self._window = int(state["window"])
        self._pass = int(state.get("pass", 0))
        self._states = {}

    def _records(self) -> Iterator[dict[str, Any]]:
        """The records from the position now on, without end: when every source is done (the mixture's
        ``all_exhausted``), the next pass reads them again from the start, in the same order; the tokens not yet
        packed carry over, so a window may hold the end of one pass and the start of the next."""
        whole = False  # this pass started at the start (the first may be a resumed one's rest)
        while True:
            read = 0
            for record in self.stream:
                read += 1
                yield record
            if whole and read == 0:
                raise ValueError("data.path: the streamed sources hold no records; point data.path at your text.")
            whole, self._pass = True, self._pass + 1
            if self.rank == 0:
                log.info(
                    "data.streaming: every source is done after %d windows; pass %d starts",
                    self._window,
                    self._pass + 1,
                )
            self.stream.load_state_dict(copy.deepcopy(self._start))
            self._stream_state = copy.deepcopy(self._start)

    def _next_window(self, records: Iterator[dict[str, Any]]) -> list[int]:
        while len(self._buffer) < self.length:
            record = next(records)
            self._buffer.extend(self.tokenize({self.field: [record[self.field]]})["ids"][0])
            # After this record: what a resume reads next (datasets updates its state in place: a copy).
            self._stream_state = copy.deepcopy(self.stream.state_dict())
        window, self._buffer = self._buffer[: self.length], self._buffer[self.length :]
        self._window += 1
        return window

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's windows, without end (the run ends at ``trainer.max_steps``): one Lightning epoch, so the
        global window index stays ``step x data.global_batch_size`` across passes."""
        records = self._records()
        while True:
            if self._window % self.world_size == 0:  # a boundary: every rank's state is the same here
                self._states[self._window] = self.state_dict()
                self._states.pop(self._window - self.kept * self.world_size, None)
            window = self._next_window(records)
            if (self._window - 1) % self.world_size == self.rank:
                tokens = torch.tensor(window, dtype=torch.long)
                yield tokens[:-1], tokens[1:]


def _hub_source(source: str, repo_id: str, revision: str | None, sample_by: str) -> Any:
    """The train split of the hub dataset ``source`` (``hf://datasets/<id>[@<rev>]``), streamed:
    ``datasets.load_dataset(<id>, streaming=True)`` reads its files through huggingface_hub's ``HfFileSystem`` (HTTP
    range requests, the token and endpoint of ``HF_TOKEN`` / ``HF_ENDPOINT``), nothing downloaded whole."""
    import datasets

    try:
        stream = datasets.load_dataset(repo_id, revision=revision, split="train", streaming=True)
        if stream.info.builder_name == "text" and sample_by != "line":  # .txt files: one record per sample_by
            stream = datasets.load_dataset(
                repo_id, revision=revision, split="train", streaming=True, sample_by=sample_by
            )
    except (OSError, ValueError) as err:  # DatasetNotFoundError, HfHubHTTPError are OSErrors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"data.path={source}: streaming its train split from the hub failed ({reason}); check the id, its "
            "revision and your access (HF_TOKEN), or give a local folder."
        ) from None
    return stream


def build_streamed_windows(cfg: Any, seed: int, rank: int, world_size: int, kept: int) -> StreamedWindows:
    """``data=hf data.streaming=true``: the train stream of ``cfg`` (its sources, ``data.weights``, the data seed)
    for one data-parallel rank."""
    files = [path if hub_stream_id(path) else [str(f) for f in corpus.corpus_files(path)] for path in sources(cfg)]
    stream = streamed_mixture(files, cfg.weights, seed, cfg.sample_by)
    tokenizer = corpus.load_tokenizer(cfg.tokenizer)
    return StreamedWindows(stream, tokenizer, cfg, rank, world_size, kept=max(kept, StreamedWindows.KEPT))
