"""A tokenizer trained on your own corpus: a byte-level BPE (HF tokenizers), saved as a transformers tokenizer folder.

``lightning-dist-prepare SOURCE... OUT --train-tokenizer VOCAB`` trains it before tokenizing, so pretraining from raw
text needs no other step. GPT-2's construction: byte-level pre-tokenization (GPT-2's split of words, numbers and
punctuation; every byte has a token, so no text is ever unknown), the 256 byte tokens, one special token
``<|endoftext|>`` (the EOS ending every document), and merges learnt by ``tokenizers``' ``BpeTrainer`` up to ``VOCAB``
tokens in all (fewer when the text has no more pairs to merge; a merge needs a pair seen twice).

The text: each source's documents, read in order and streamed (a hub dataset by range requests, at the commit its
revision names now), until its share (``--weights``, equal without) of ``--tokenizer-chars`` characters (default
10^9, about 1 GB of text: the BPE of GPT-2-sized vocabularies changes little past that). The same sources, budget and
vocabulary give the same tokenizer, byte for byte: ``OUT/tokenizer`` is reused by a run started again with them (its
key in ``OUT/tokenizer/lightning-dist-tokenizer.json``), and so are the sources it tokenized.

Saved with ``PreTrainedTokenizerFast.save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``): ``AutoTokenizer.from_pretrained(OUT/tokenizer)`` loads it, ``data=hf
data.tokenizer=OUT/tokenizer`` reads with it, and ``lightning-dist-export`` copies it next to the weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from lightning_dist.data import corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.sources import Source, open_source, parse_source
from lightning_dist.hub import HUB_STREAM, hub_stream

#: Characters of text read to train a tokenizer, over all sources (``--tokenizer-chars``).
TOKENIZER_CHARS = 1e9
#: The one special token: the EOS after every document (GPT-2's).
EOS = "<|endoftext|>"
#: The key of the sources, budget and vocabulary a saved tokenizer was trained on.
KEY_FILE = "lightning-dist-tokenizer.json"
_BYTES = 256


def train_tokenizer(
    sources: Sequence[str],
    folder: Path,
    vocab_size: int,
    text_field: str = "text",
    weights: Sequence[float] | None = None,
    max_chars: int = int(TOKENIZER_CHARS),
    sample_by: str = "document",
) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``sources`` into ``folder`` (module docstring).

    Returns:
        ``folder``.

    Raises:
        ValueError: A vocabulary smaller than the bytes and EOS, a bad budget or weights, a source that cannot be read
            (one line each).
    """
    if vocab_size < _BYTES + 1:
        raise ValueError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE holds the 256 bytes and {EOS}, so at least 257 tokens; "
            "give e.g. 32000"
        )
    if max_chars < 1:
        raise ValueError(f"--tokenizer-chars {max_chars} must be >= 1 (characters of text to train on)")
    shares = Blend(list(weights), "--weights").weights if weights else [1 / len(sources)] * len(sources)
    specs = [_pinned(parse_source(source, "SOURCE")) for source in sources]
    key = _key(specs, vocab_size, text_field, shares, max_chars, sample_by)
    saved = folder / KEY_FILE
    if saved.is_file() and json.loads(saved.read_text()).get("key") == key:
        print(f"{folder}: trained by an earlier run on the same text", flush=True)
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # optional: [hf]
    from transformers import PreTrainedTokenizerFast  # optional dependency: lightning-dist[hf]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=True,
    )
    budgets = [int(max_chars * share) for share in shares]
    texts = (text for spec, budget in zip(specs, budgets) for text in _texts(spec, text_field, budget, sample_by))
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    saved.write_text(json.dumps({"key": key, "sources": list(sources), "vocab_size": vocab_size}) + "\n")
    size = len(fast)
    note = "" if size == vocab_size else f" (the text has no pair left to merge past {size}; {vocab_size} asked)"
    print(f"{folder}: a byte-level BPE of {size:,} tokens{note}", flush=True)
    return folder


def _pinned(spec: Source) -> Source:
    """A hub source read at the commit its revision names now (every document of one training from one commit)."""
    if spec.hub is None or spec.location.startswith(HUB_STREAM):
        return spec
    return replace(spec, location=hub_stream("SOURCE", spec.location, pinned=True))


def _texts(spec: Source, text_field: str, budget: int, sample_by: str) -> Iterator[str]:
    """``spec``'s documents, in order, until ``budget`` characters (the last one cut there)."""
    records = open_source(spec, sample_by, streaming=True)
    field = "text" if getattr(records.info, "builder_name", None) == "text" else text_field
    read = 0
    for record in records:
        if field not in record:
            raise ValueError(
                f"SOURCE={spec.text}: its records have no {field!r} field (they have {', '.join(record)}); pass "
                "--text-field with the field that holds the text"
            )
        text = record[field][: budget - read]
        read += len(text)
        yield text
        if read >= budget:
            return


def _key(specs: list[Source], vocab: int, field: str, shares: list[float], chars: int, sample_by: str) -> str:
    """What the tokenizer depends on: the sources (a local file's path, size and modification time; a hub source's
    commit), the budget, the shares, the vocabulary."""
    digest = hashlib.sha256(json.dumps([vocab, field, shares, chars, sample_by]).encode())
    for spec in specs:
        digest.update(repr(spec).encode())
        if spec.hub is None:
            for file in corpus.corpus_files(spec.location, "SOURCE"):
                stat = file.stat()
                digest.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
