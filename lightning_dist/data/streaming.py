"""A streamed corpus for corpora larger than disk: sources read as they are needed, tokenized and packed on the fly,
blended by index, dealt to the data-parallel ranks so that each can read only its share, with a position that a
resume continues from exactly.

**Sources** are datasets' streaming ``IterableDataset`` s (:func:`lightning_dist.data.sources.open_source`: local
files, or a hub dataset, never downloaded whole). Each source's records are tokenized by ``data=hf``'s batched function
(EOS after each document) and packed into windows of ``seq_len + 1`` tokens on their own, so a window holds one
source's tokens. When a source's records are done it starts another pass over them, in the same order (the tokens not
yet packed carry over, so a window may hold the end of one pass and the start of the next): the stream has no end,
and the run ends at ``trainer.max_steps``.

**Streams** (``data.num_streams``, S): the shards (files) of every source are dealt to S streams, stream s reading
shards s, s + S, ... (datasets' ``split_dataset_by_node(source, rank=s, world_size=S)``; a source whose number of
shards S does not divide is read whole by every stream, each keeping every S-th record, and a warning says so). Each
stream blends its share of the sources by index (:class:`~lightning_dist.data.blend.Blend`: ``data.weights`` are
shares of the windows, so of the tokens, exact to under one window). Global window g is stream ``g mod S``'s next.

**Ranks**: data-parallel rank r of D trains on the windows ``g = r (mod D)``, as ``DistributedSampler`` deals an epoch,
so the global batch of step k (windows ``kG .. kG+G-1``) is the same under every D; and it reads only the streams those
come from, ``s = r (mod gcd(S, D))``. With S a multiple of D each rank reads S / D streams and keeps every window of
them: it reads only its own shards. With S = 1 (the default) every rank reads the one stream, tokenizes all of it and
keeps every D-th window. The windows, so the curve, depend on S, not on D: changing the data-parallel size keeps the
batches; changing ``data.num_streams`` changes them (a resume refuses it).

**The position** is global: :meth:`StreamedWindows.state_dict` holds the next window's index and the state of each
stream (per source: datasets' own state of its records, the tokens read but not yet packed, its pass; and how many
windows each source gave). A rank holds the states of the streams it reads; :func:`merge_states` joins the ranks'
into the whole position, which :meth:`~StreamedWindows.load_state_dict` continues from exactly on any rank of any
data-parallel size. :meth:`~StreamedWindows.state_at` gives the state before a given window among the last few
boundaries passed (a loader reads ahead of training: a checkpoint wants the state before the first window not yet
trained on). No distributed code here: the caller gives the rank and world size, and gathers the states.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_dist.data import corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.config import sources
from lightning_dist.data.sources import open_source, parse_source

log = logging.getLogger(__name__)


class SourceWindows:
    """One source's records (one stream's share of them) as windows of ``length`` tokens, pass after pass.

    Args:
        records: A datasets streaming ``IterableDataset`` (anything with ``__iter__``, ``state_dict`` and
            ``load_state_dict``).
        tokenize: ``data=hf``'s batched tokenizing function.
        field: The records' text field.
        length: Tokens per window (``seq_len + 1``).
        name: The source, for messages.
    """

    def __init__(self, records: Any, tokenize: corpus.Tokenize, field: str, length: int, name: str) -> None:
        self.records, self.tokenize, self.field, self.length, self.name = records, tokenize, field, length, name
        self._start = copy.deepcopy(records.state_dict())  # where a pass starts
        self._buffer: list[int] = []
        self._pass = 0
        self._iterator: Iterator[dict[str, Any]] | None = None
        self._read = 0  # records read by this iterator
        self._whole = True  # this iterator started at the start of a pass
        # The records' state until the iterator reads a record (datasets reports its own only once iterating).
        self._loaded: dict[str, Any] | None = copy.deepcopy(self._start)

    def state_dict(self) -> dict[str, Any]:
        """Datasets' state of the records (what a resume reads next), the tokens not yet packed, the pass (0 first)."""
        records = self._loaded if self._loaded is not None else self.records.state_dict()
        return {"records": copy.deepcopy(records), "buffer": list(self._buffer), "pass": self._pass}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of the same source's share)."""
        self.records.load_state_dict(copy.deepcopy(state["records"]))
        self._loaded = copy.deepcopy(state["records"])
        self._buffer, self._pass = list(state["buffer"]), int(state["pass"])
        self._iterator, self._whole = None, False

    def next_window(self) -> list[int]:
        """The next ``length`` tokens."""
        while len(self._buffer) < self.length:
            record = self._next_record()
            self._buffer.extend(self.tokenize({self.field: [record[self.field]]})["ids"][0])
        window, self._buffer = self._buffer[: self.length], self._buffer[self.length :]
        return window

    def _next_record(self) -> dict[str, Any]:
        while True:
            if self._iterator is None:
                self._iterator, self._read = iter(self.records), 0
            try:
                record = next(self._iterator)
            except StopIteration:
                if self._whole and self._read == 0:
                    raise ValueError(
                        f"data.path: the streamed source {self.name} holds no records; point data.path at your text."
                    ) from None
                self._next_pass()
                continue
            self._read += 1
            self._loaded = None
            return record

    def _next_pass(self) -> None:
        """Every record read: the next pass reads them again from the start, in the same order."""
        self.records.load_state_dict(copy.deepcopy(self._start))
        self._loaded = copy.deepcopy(self._start)
        self._pass += 1
        self._iterator, self._whole = None, True
        log.debug("data.streaming: %s starts pass %d", self.name, self._pass + 1)


class BlendedStream:
    """One stream: its share of every source, blended by index (``blend``)."""

    def __init__(self, sources: list[SourceWindows], blend: Blend) -> None:
        self.sources, self.blend = sources, blend
        self.counts = [0] * len(sources)  # windows each source gave

    def next_window(self) -> list[int]:
        j = self.blend.next_source(self.counts)
        self.counts[j] += 1
        return self.sources[j].next_window()

    def state_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sources": [source.state_dict() for source in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ValueError(
                f"the checkpoint's stream position blends {len(state['sources'])} sources and data.path has "
                f"{len(self.sources)}; resume with the sources it was saved with"
            )
        self.counts = [int(c) for c in state["counts"]]
        for source, saved in zip(self.sources, state["sources"]):
            source.load_state_dict(saved)


class StreamedWindows(IterableDataset):
    """``(inputs, targets)`` windows of ``seq_len`` tokens from streamed sources, this rank's share, resumable.

    Args:
        records: Each source's records, a datasets streaming ``IterableDataset`` (:func:`open_source`).
        tokenizer: The tokenizer (``corpus.load_tokenizer``).
        data: The data config (its ``format`` must be ``text``; ``text_field``, ``seq_len``, ``weights``,
            ``num_streams``).
        rank: This data-parallel rank; ``world_size``: how many there are.
        kept: How many of the last boundaries' states :meth:`state_at` can give (more than the loader reads ahead).
        names: The sources as ``data.path`` names them, for messages.
    """

    #: Boundaries (windows that are multiples of the world size) whose states are kept for :meth:`state_at`.
    KEPT = 64

    def __init__(
        self,
        records: Sequence[Any],
        tokenizer: Any,
        data: Any,
        rank: int = 0,
        world_size: int = 1,
        kept: int = KEPT,
        names: Sequence[str] | None = None,
    ) -> None:
        if data.format != "text":
            raise ValueError(f"data.streaming reads data.format=text; data.format={data.format} is cached only.")
        if not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} is outside [0, {world_size}); check the strategy's sizes")
        weights = list(data.weights) if data.weights is not None else [1] * len(records)
        if len(weights) != len(records):
            raise ValueError(f"data.weights={weights}: give one positive weight per source ({len(records)} sources).")
        blend = Blend(weights, "data.weights")
        self.rank, self.world_size, self.kept = rank, world_size, kept
        self.num_streams = int(getattr(data, "num_streams", 1))
        names = list(names) if names is not None else [f"source {j}" for j in range(len(records))]
        tokenize = corpus.Tokenize(tokenizer, data)
        # The streams whose windows this rank trains on: g = rank (mod world_size) comes from stream g mod S.
        every = math.gcd(self.num_streams, world_size)
        #: The streams this rank reads.
        self.reads = [s for s in range(self.num_streams) if s % every == rank % every]
        self._streams = {
            s: BlendedStream(
                [
                    SourceWindows(
                        _share(source, s, self.num_streams), tokenize, data.text_field, data.seq_len + 1, name
                    )
                    for source, name in zip(records, names)
                ],
                blend,
            )
            for s in self.reads
        }
        self._window = 0  # the global index of the next window
        self._states: dict[int, dict[str, Any]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The position now: the next window's global index, ``data.num_streams``, and the state of each stream this
        rank reads (``None`` for the others: :func:`merge_states` joins the ranks')."""
        return {
            "window": self._window,
            "num_streams": self.num_streams,
            "streams": [self._streams[s].state_dict() if s in self._streams else None for s in range(self.num_streams)],
        }

    def state_at(self, window: int) -> dict[str, Any]:
        """The state before global window ``window`` (a multiple of the world size among the last ``kept``)."""
        if window not in self._states:
            raise ValueError(f"the stream's state before window {window} is not kept (kept: {sorted(self._states)}).")
        return copy.deepcopy(self._states[window])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (the whole position: :meth:`state_dict` of every stream, merged; any rank and
        data-parallel size, the same sources and ``data.num_streams``)."""
        state = _upgraded(state, len(next(iter(self._streams.values())).sources))
        if int(state["num_streams"]) != self.num_streams:
            raise ValueError(
                f"the checkpoint's stream position is of data.num_streams={state['num_streams']} and this run has "
                f"data.num_streams={self.num_streams}; resume with data.num_streams={state['num_streams']} (the "
                "streams decide which documents each window holds)"
            )
        for s, stream in self._streams.items():
            if state["streams"][s] is None:
                raise ValueError(
                    f"the checkpoint's stream position holds no state of stream {s}; it was saved by a rank that did "
                    "not gather every rank's streams: resume from another checkpoint"
                )
            stream.load_state_dict(state["streams"][s])
        self._window = int(state["window"])
        self._states = {}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's windows, without end (the run ends at ``trainer.max_steps``): one Lightning epoch, so the
        global window index stays ``step x data.global_batch_size``."""
        while True:
            g = self._window
            if g % self.world_size == 0:  # a boundary: a step starts at one (the global batch is a multiple)
                self._states[g] = self.state_dict()
                self._states.pop(g - self.kept * self.world_size, None)
            stream = self._streams.get(g % self.num_streams)  # None: another rank's stream, none of this rank's
            window = stream.next_window() if stream is not None else None
            self._window += 1
            if g % self.world_size == self.rank:
                tokens = torch.tensor(window, dtype=torch.long)
                yield tokens[:-1], tokens[1:]


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole position from the ranks' :meth:`StreamedWindows.state_at` of one window: each stream's state from a
    rank that reads it.

    Raises:
        ValueError: The states are of different windows, or no rank reads a stream (one line).
    """
    windows = {int(state["window"]) for state in states}
    if len(windows) != 1:
        raise ValueError(f"the ranks' stream positions are at different windows {sorted(windows)}; they must agree")
    merged = copy.deepcopy(states[0])
    for s in range(int(merged["num_streams"])):
        if merged["streams"][s] is None:
            merged["streams"][s] = next((state["streams"][s] for state in states if state["streams"][s]), None)
        if merged["streams"][s] is None:
            raise ValueError(f"no rank holds the state of stream {s} of {merged['num_streams']}; every stream is read")
    return merged


def _share(records: Any, stream: int, num_streams: int) -> Any:
    """Stream ``stream``'s share of a source's records: its shards ``stream, stream + S, ...``."""
    if num_streams == 1:
        return records
    from datasets.distributed import split_dataset_by_node  # optional dependency: lightning-dist[hf]

    return split_dataset_by_node(records, rank=stream, world_size=num_streams)


def _upgraded(state: dict[str, Any], num_sources: int) -> dict[str, Any]:
    """A position saved before streams and blends (one record stream: ``{window, pass, stream, buffer}``) as one
    stream of one source; a mixture's cannot be continued (its windows mixed the sources' records)."""
    if "streams" in state:
        return state
    if num_sources != 1:
        raise ValueError(
            "the checkpoint's stream position is of a mixture drawn record by record (before mixtures by index); it "
            "cannot be continued: start the run again, or resume with the version that saved it"
        )
    source = {"records": state["stream"], "buffer": state["buffer"], "pass": state.get("pass", 0)}
    return {
        "window": state["window"],
        "num_streams": 1,
        "streams": [{"counts": [state["window"]], "sources": [source]}],
    }


def build_streamed_windows(cfg: Any, rank: int, world_size: int, kept: int) -> StreamedWindows:
    """``data=hf data.streaming=true``: the train stream of ``cfg`` (its sources, ``data.weights``,
    ``data.num_streams``) for one data-parallel rank."""
    specs = [parse_source(path, "data.path") for path in sources(cfg)]
    records = [open_source(spec, cfg.sample_by, streaming=True, where="data.path") for spec in specs]
    num_streams = int(getattr(cfg, "num_streams", 1))
    for spec, source in zip(specs, records):
        shards = getattr(source, "num_shards", None) or getattr(source, "n_shards", 1)
        if rank == 0 and num_streams > 1 and shards % num_streams:
            log.warning(
                "data.num_streams=%d: data.path source %s has %d shards, not a multiple of it, so every stream reads "
                "all of it and keeps every %d-th record; give it a multiple of %d files for each rank to read only "
                "its own",
                num_streams,
                spec.text,
                shards,
                num_streams,
                num_streams,
            )
    tokenizer = corpus.load_tokenizer(cfg.tokenizer)
    names = [spec.text for spec in specs]
    return StreamedWindows(records, tokenizer, cfg, rank, world_size, max(kept, StreamedWindows.KEPT), names)
