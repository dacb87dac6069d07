"""``lightning-dist-prepare SOURCE... --tokenizer T OUT``: a corpus tokenized once into the ``train.bin`` /
``val.bin`` that ``data=tokens`` reads.

Each source is a file, a folder or a glob of ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files (as ``data=hf``
reads them), or a hub dataset id (``org/name``, downloaded into the HuggingFace cache as ``data.path`` is), with options
after a ``?`` (:mod:`lightning_dist.data.sources`; quote it in a shell): ``name=<config>``, ``split=<split>``,
``data_files=<glob>`` read only that part of a hub dataset (its files alone downloaded), ``max_tokens=<n>`` (``2e9``,
``2B``) only its first n tokens, streamed: reading stops there, and a hub dataset is fetched by range requests only as
far as that. Its documents are tokenized by datasets' ``map`` in ``--num-proc`` processes with its progress bar (the
same batched function as ``data=hf``: each document ended by EOS), and its tokens written to
``OUT/.work/<source>.bin``.

**A mixture, by index**: each source's tokens are written to ``train.bin`` once, one after the other; ``--weights 0.2
0.3 0.5`` is each source's share of the mixture (normalized), which ``OUT/meta.json`` records as a blend that
``data=tokens`` reads by index (:func:`lightning_dist.data.files.blend_starts`): the mixture's windows come from the
sources in those shares, to under one window among any first n (:class:`lightning_dist.data.blend.Blend`), a source
with more windows than its share giving an even spread of them, one with fewer repeating each evenly. The mixture
holds ``--train-tokens`` tokens (default: all the sources'). Without ``--weights``: the sources one after the other,
each token once. The last ``--val-fraction`` of each source's tokens goes to ``val.bin``, so validation measures each
source in its own proportion and never a window trained on.

**Your own tokenizer**: ``--train-tokenizer VOCAB`` instead of ``--tokenizer`` first trains a byte-level BPE of VOCAB
tokens on the sources' text (HF tokenizers, :mod:`lightning_dist.data.tokenizer_training`) into ``OUT/tokenizer``,
then tokenizes with it: pretraining from raw text needs no other step.

**Resumable**: a source's ``.bin`` is written under a temporary name and renamed when whole, so a stopped run, started
again with the same arguments, skips the sources it finished (their names hash the source's files, sizes and
modification times or its hub selection and commit, the tokenizer and the text field); datasets keeps the tokenized
Arrow files of a finished ``map`` in ``OUT/.work/datasets``. ``OUT/meta.json`` says what was written: the tokenizer,
the vocabulary, the element type (``data.token_dtype``: uint16 up to 65,536 tokens, else uint32), each source's tokens
and the blend.

Examples::

    lightning-dist-prepare input.txt --tokenizer gpt2-tokenizer/ tokens/
    lightning-dist-prepare corpus/ --train-tokenizer 32000 out/
    lightning-dist-prepare web/ 'HuggingFaceFW/fineweb-edu?name=sample-10BT&max_tokens=2B' --weights 0.3 0.7 \\
        --tokenizer meta-llama/Llama-3.1-8B out/
    lightning-dist-train cluster=gpu model=llama_1b data=tokens data.path=out/ data.token_dtype=uint32 \\
        model.vocab_size=128256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dist.data import corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.config import DataConfig
from lightning_dist.data.sources import Source, open_source, parse_source
from lightning_dist.data.tokenizer_training import TOKENIZER_CHARS, train_tokenizer
from lightning_dist.hub import HUB_STREAM, hub_snapshot, hub_stream, looks_like_hub_id
from lightning_dist.manifest import DATA_MANIFEST, write_manifest


def _source_files(source: str) -> list[Path]:
    """The files of ``source``: a local path or glob, else a hub dataset id's snapshot."""
    if not Path(source).expanduser().exists() and looks_like_hub_id(source):
        source = str(hub_snapshot("SOURCE", source, kind="dataset"))
    return corpus.corpus_files(source, "SOURCE")


def _tokenizer_folder(name: str) -> str:
    return str(hub_snapshot("--tokenizer", name)) if not Path(name).exists() and looks_like_hub_id(name) else name


def _key(files: list[Path], tokenizer: str, text_field: str) -> str:
    digest = hashlib.sha256(text_field.encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    for file in corpus.tokenizer_files(tokenizer):
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def tokenize_source(source: str, data: Any, work: Path, dtype: Any) -> Path:
    """``OUT/.work/<key>.bin``: every document of ``source`` tokenized and ended by EOS, in file order; written
    once (an existing one is a finished earlier run's)."""
    spec = parse_source(source, "SOURCE")
    pinned = spec.location.startswith(HUB_STREAM)  # hf://datasets/<id>@<commit>: read through datasets too
    if spec.max_tokens is not None or (spec.hub is not None and (spec.selects or pinned)):
        return tokenize_selected(spec, data, work, dtype)
    files = _source_files(source)
    if corpus.SUFFIXES[files[0].suffix.lower()] == "text":
        data = replace(data, text_field="text")  # datasets' text loader: one "text" column, whatever --text-field says
    key = _key(files, data.tokenizer, data.text_field)
    done = work / f"{key}.bin"
    if done.is_file():
        print(f"{source}: tokenized by an earlier run ({done.name})", flush=True)
        return done
    tokenizer = corpus.load_tokenizer(data.tokenizer)
    records = corpus.load_records(files, data, work / "datasets", "SOURCE")
    encoded = corpus.tokenize(records, tokenizer, data, fingerprint=f"lightning-dist-prepare-{key}")
    partial = work / f"{key}.bin.partial"
    with partial.open("wb") as out:
        for chunk in encoded.data.column("ids").chunks:
            out.write(np.asarray(chunk.flatten(), dtype=dtype).tobytes())
    os.replace(partial, done)  # whole, or not there: a stopped run redoes this source only
    return done


def tokenize_selected(spec: Source, data: Any, work: Path, dtype: Any) -> Path:
    """``tokenize_source`` for a source with options (:mod:`lightning_dist.data.sources`): a hub dataset's config,
    split or files, read at the commit its revision names now; with ``max_tokens``, streamed (local files too) and
    tokenized only until the cap, so a hub dataset is fetched by range requests only as far as that; without, the
    selected files downloaded into datasets' cache and tokenized in ``--num-proc`` processes."""
    if spec.hub is not None and not spec.location.startswith(HUB_STREAM):  # pinned: every part read at one commit
        spec = replace(spec, location=hub_stream("SOURCE", spec.location, pinned=True))
    files = [] if spec.hub is not None else corpus.corpus_files(spec.location, "SOURCE")
    if files and corpus.SUFFIXES[files[0].suffix.lower()] == "text":
        data = replace(data, text_field="text")  # datasets' text loader: one "text" column, whatever --text-field says
    digest = hashlib.sha256(repr((spec.location, spec.name, spec.split, spec.data_files, spec.max_tokens)).encode())
    key = hashlib.sha256(f"{digest.hexdigest()}|{_key(files, data.tokenizer, data.text_field)}".encode()).hexdigest()
    done = work / f"{key[:16]}.bin"
    if done.is_file():
        print(f"{spec.text}: tokenized by an earlier run ({done.name})", flush=True)
        return done
    tokenizer = corpus.load_tokenizer(data.tokenizer)
    records = open_source(spec, data.sample_by, streaming=spec.max_tokens is not None)
    partial = done.with_suffix(".bin.partial")
    if spec.max_tokens is None:
        _check_text_field(records.column_names, spec, data.text_field)
        encoded = corpus.tokenize(records, tokenizer, data, fingerprint=f"lightning-dist-prepare-{key[:16]}")
        with partial.open("wb") as out:
            for chunk in encoded.data.column("ids").chunks:
                out.write(np.asarray(chunk.flatten(), dtype=dtype).tobytes())
    else:
        written = _write_until(records, corpus.Tokenize(tokenizer, data), spec, data.text_field, partial, dtype)
        if written < spec.max_tokens:
            print(f"{spec.text}: {written:,} tokens, all it holds (fewer than max_tokens={spec.max_tokens:,})")
    os.replace(partial, done)  # whole, or not there: a stopped run redoes this source only
    return done


def _write_until(records: Any, tokenize: Any, spec: Source, field: str, path: Path, dtype: Any) -> int:
    """Stream ``records``' documents into ``path`` as tokens until ``spec.max_tokens`` (the last document cut there);
    returns the tokens written. Reading stops there: the rest of the source is never fetched."""
    from datasets.utils.tqdm import tqdm  # optional dependency: lightning-dist[hf] (its progress bars, as map's)

    written = 0
    with path.open("wb") as out, tqdm(total=spec.max_tokens, unit="tok", desc="tokenizing", unit_scale=True) as bar:
        for batch in records.iter(batch_size=64):  # small: reading stops soon after the cap
            if field not in batch:
                _check_text_field(list(batch), spec, field)
            ids = tokenize({field: batch[field]})["ids"]
            tokens = np.fromiter((t for doc in ids for t in doc), dtype=np.int64)[: spec.max_tokens - written]
            out.write(tokens.astype(dtype).tobytes())
            written += len(tokens)
            bar.update(len(tokens))
            if written >= spec.max_tokens:
                break
    return written


def _check_text_field(columns: list[str] | None, spec: Source, field: str) -> None:
    if columns is not None and field not in columns:
        raise ValueError(
            f"SOURCE={spec.text}: its records have no {field!r} field (they have {', '.join(columns)}); pass "
            "--text-field with the field that holds the text"
        )


def write_splits(
    out: Path,
    sources: list[str],
    parts: list[np.ndarray],
    val_fraction: float,
    blend: Blend | None,
    train_tokens: int | None,
) -> dict[str, Any]:
    """``out/train.bin``: each source's tokens once, one after the other, less its last ``val_fraction``, which goes to
    ``out/val.bin``; with ``blend``, ``data=tokens`` reads ``train.bin`` by the blend's index (module docstring): the
    meta it needs (each source's offset and tokens, the integer shares, the mixture's tokens) is returned."""
    entries: list[dict[str, Any]] = []
    offset = 0
    with (out / "train.bin.partial").open("wb") as train, (out / "val.bin.partial").open("wb") as val:
        for source, tokens in zip(sources, parts):
            held = int(len(tokens) * val_fraction)
            kept = tokens[: len(tokens) - held]
            train.write(np.asarray(kept).tobytes())
            val.write(np.asarray(tokens[len(kept) :]).tobytes())
            entries.append(
                {
                    "source": source,
                    "tokens": len(tokens),
                    "offset": offset,
                    "train_tokens": len(kept),
                    "val_tokens": held,
                }
            )
            offset += len(kept)
    for name in ("train.bin", "val.bin"):
        os.replace(out / f"{name}.partial", out / name)
    meta: dict[str, Any] = {"sources": entries, "train_tokens": offset}
    if blend is not None:
        total = int(train_tokens) if train_tokens is not None else offset
        for entry, weight, share in zip(entries, blend.weights, blend.shares):
            entry.update(weight=weight, share=share, blend_tokens=total * share // blend.period)
        meta.update(blend={"shares": blend.shares, "train_tokens": total}, train_tokens=total)
    return meta


def prepare(
    sources: list[str],
    out: Path,
    tokenizer: str,
    weights: list[float] | None = None,
    val_fraction: float = 0.0005,
    num_proc: int | None = None,
    text_field: str = "text",
    train_tokens: int | None = None,
) -> dict[str, Any]:
    """Write ``out/train.bin``, ``out/val.bin`` and ``out/meta.json`` (module docstring); returns the meta.

    Raises:
        ValueError: Weights not one per source or not positive, a fraction outside [0, 1), a source or tokenizer
            that cannot be read (one line each).
    """
    blend = Blend(weights, "--weights") if weights else None
    if blend is not None and len(blend.shares) != len(sources):
        raise ValueError(f"--weights {list(weights)}: give one positive weight per source ({len(sources)} sources).")
    if train_tokens is not None and blend is None:
        raise ValueError(f"--train-tokens {train_tokens} sizes a mixture; give --weights too, or leave it out")
    if train_tokens is not None and train_tokens < 1:
        raise ValueError(f"--train-tokens {train_tokens} must be >= 1 (the mixture's tokens; leave it out for all).")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1).")
    folder = _tokenizer_folder(tokenizer)
    data = replace(DataConfig(kind="hf", tokenizer=folder), num_proc=num_proc, text_field=text_field)
    vocab = len(corpus.load_tokenizer(folder))
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    parts = [np.memmap(tokenize_source(s, data, work, dtype), dtype=dtype, mode="r") for s in sources]
    meta: dict[str, Any] = {"tokenizer": tokenizer, "vocab_size": vocab, "token_dtype": np.dtype(dtype).name}
    meta.update(write_splits(out, sources, parts, val_fraction, blend, train_tokens))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(out, DATA_MANIFEST, ["train.bin", "val.bin", "meta.json"])  # checked before data=tokens reads it
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="files, a folder, a glob, or a hub dataset id, with options: '<id>?name=<config>&max_tokens=2B'",
    )
    parser.add_argument("out", metavar="OUT", help="the folder data=tokens reads (data.path=OUT)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", help="a tokenizer (or model) folder, or a hub model id")
    which.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB tokens on the sources (HF tokenizers) into OUT/tokenizer, and use it",
    )
    parser.add_argument(
        "--tokenizer-chars", type=float, default=TOKENIZER_CHARS, help="--train-tokenizer: characters of text to read"
    )
    parser.add_argument("--weights", nargs="+", type=float, help="each source's share of the mixture (no copies)")
    parser.add_argument("--train-tokens", type=float, help="with --weights: the mixture's tokens (default: all)")
    parser.add_argument("--val-fraction", type=float, default=0.0005, help="each source's last tokens held out")
    parser.add_argument("--num-proc", type=int, help="tokenizing processes (default min(8, CPU count))")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl / .parquet records")
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.sources,
            Path(args.out),
            _tokenizer_of(args),
            args.weights,
            args.val_fraction,
            args.num_proc,
            args.text_field,
            int(args.train_tokens) if args.train_tokens is not None else None,
        )
    except ValueError as err:
        sys.exit(f"lightning-dist-prepare: {err}")
    train = meta["train_tokens"]
    print(
        f"{args.out}: {train:,} train tokens; data=tokens data.path={args.out} "
        f"data.token_dtype={meta['token_dtype']} model.vocab_size={meta['vocab_size']}"
    )


def _tokenizer_of(args: argparse.Namespace) -> str:
    """``--tokenizer``, or the one ``--train-tokenizer`` trains on the sources into ``OUT/tokenizer``."""
    if args.train_tokenizer is None:
        return args.tokenizer
    folder = train_tokenizer(
        args.sources,
        Path(args.out) / "tokenizer",
        args.train_tokenizer,
        text_field=args.text_field,
        weights=args.weights,
        max_chars=int(args.tokenizer_chars),
    )
    return str(folder)


if __name__ == "__main__":
    main()
