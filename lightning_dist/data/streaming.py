"""A streamed corpus for corpora larger than disk: a weighted mixture of sources read as they are needed, tokenized and
packed on the fly, with a position that a resume continues from exactly.

The sources are datasets' streaming ``IterableDataset`` s (``load_dataset(..., streaming=True)``: local files or a hub
dataset, never downloaded whole), mixed by ``interleave_datasets`` with the given probabilities and seed (every source
read until all are exhausted, the shorter ones started again), and split between the data-parallel ranks by
``split_dataset_by_node``. Each record is tokenized by ``data=hf``'s batched function (EOS after each document) and
the tokens packed into windows of ``seq_len + 1`` as ``data=hf`` packs them.

**The position**: :meth:`StreamedWindows.state_dict` after ``n`` windows is datasets' own state of the mixture (which
record of which source is next, and its random generator) plus the tokens read but not yet packed;
:meth:`~StreamedWindows.load_state_dict` on a new instance makes it yield window ``n + 1`` next, exactly as the first
instance would have. No distributed code here; the caller gives the rank and world size.

Not yet wired into the app (``data.streaming``): this is the dataset and its state, tested on its own.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_dist.data import corpus


def streamed_mixture(files: Sequence[Sequence[str]], weights: Sequence[float] | None, seed: int) -> Any:
    """datasets' streaming mixture of ``files`` (one list of files per source), drawn with ``weights`` (normalized)."""
    import datasets  # optional dependency: lightning-dist[hf]

    sources = []
    for group in files:
        loader = corpus.SUFFIXES[Path(group[0]).suffix.lower()]
        sources.append(datasets.load_dataset(loader, data_files=list(map(str, group)), split="train", streaming=True))
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
    """

    def __init__(self, stream: Any, tokenizer: Any, data: Any, rank: int = 0, world_size: int = 1) -> None:
        from datasets.distributed import split_dataset_by_node  # optional dependency: lightning-dist[hf]

        if data.format != "text":
            raise ValueError(f"data.streaming reads data.format=text; data.format={data.format} is cached only.")
        self.stream = split_dataset_by_node(stream, rank=rank, world_size=world_size) if world_size > 1 else stream
        self.tokenize = corpus.Tokenize(tokenizer, data)
        self.field = data.text_field
        self.length = data.seq_len + 1
        self._buffer: list[int] = []
        self._stream_state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position after the last window yielded: the mixture's state and the tokens not yet packed."""
        stream = self._stream_state or copy.deepcopy(self.stream.state_dict())
        return {"stream": copy.deepcopy(stream), "buffer": list(self._buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of an instance over the same sources, seed and rank)."""
        self.stream.load_state_dict(copy.deepcopy(state["stream"]))
        self._stream_state = copy.deepcopy(state["stream"])
        self._buffer = list(state["buffer"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        records = iter(self.stream)
        while True:
            while len(self._buffer) < self.length:
                record = next(records, None)
                if record is None:
                    return
                self._buffer.extend(self.tokenize({self.field: [record[self.field]]})["ids"][0])
                # After this record: what a resume reads next (datasets updates its state in place: a copy).
                self._stream_state = copy.deepcopy(self.stream.state_dict())
            window, self._buffer = self._buffer[: self.length], self._buffer[self.length :]
            tokens = torch.tensor(window, dtype=torch.long)
            yield tokens[:-1], tokens[1:]
