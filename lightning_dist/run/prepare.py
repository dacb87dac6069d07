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
        data.vocab_size=128256 model.vocab_size=128256 data.seq_len=2048

It ends by printing the ``lightning-dist-train`` command that trains on OUT as it is (its vocabulary, element type
and ``--seq-len`` windows). The splits are sized for it before anything is written: a validation window for each
process of the default layout, and a batch of training windows (a smaller batch, named in the command, for a small
corpus); ``--seq-len`` and ``--val-fraction``, when not given, are chosen to fit (one line says so), and given values
that do not fit are refused in one line naming what would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from lightning_dist.config.schema import CONF_DIR
from lightning_dist.data import corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.config import DataConfig
from lightning_dist.data.sources import Source, open_source, parse_source
from lightning_dist.data.tokenizer_training import TOKENIZER_CHARS, train_tokenizer
from lightning_dist.hub import HUB_STREAM, hub_snapshot, hub_stream, looks_like_hub_id
from lightning_dist.manifest import DATA_MANIFEST, write_manifest
from lightning_dist.models.gpt_config import GPTConfig

#: The part of each source held out for validation when ``--val-fraction`` is not given (nanoGPT's share), raised
#: for a small corpus to :data:`VAL_WINDOWS` windows.
VAL_FRACTION = 0.0005
#: The windows ``--seq-len`` tries when not given, longest first: the default model's context, then halves.
SEQ_LENS = tuple(GPTConfig().max_seq_len >> i for i in range(6))
#: What the printed command needs on the default config: a batch of windows (conf/data/tokens.yaml), and a
#: validation window for each process of the default layout (conf/cluster/local_cpu.yaml).
TRAIN_WINDOWS = int(OmegaConf.load(CONF_DIR / "data" / "tokens.yaml").global_batch_size)
VAL_WINDOWS = int(OmegaConf.load(CONF_DIR / "cluster" / "local_cpu.yaml").devices)


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
    val_fraction: float | None = VAL_FRACTION,
    num_proc: int | None = None,
    text_field: str = "text",
    train_tokens: int | None = None,
    seq_len: int | None = None,
    sized: bool = False,
) -> dict[str, Any]:
    """Write ``out/train.bin``, ``out/val.bin`` and ``out/meta.json`` (module docstring); returns the meta.

    ``sized``: the splits are checked for the printed command (:func:`size_splits`: ``val_fraction`` and ``seq_len``
    ``None`` are chosen there) before ``train.bin`` and ``val.bin`` are written; the meta's ``seq_len`` is the window.

    Raises:
        ValueError: Weights not one per source or not positive, a fraction outside [0, 1), a source or tokenizer
            that cannot be read, splits too short for the printed command (one line each).
    """
    blend = Blend(weights, "--weights") if weights else None
    if blend is not None and len(blend.shares) != len(sources):
        raise ValueError(f"--weights {list(weights)}: give one positive weight per source ({len(sources)} sources).")
    if train_tokens is not None and blend is None:
        raise ValueError(f"--train-tokens {train_tokens} sizes a mixture; give --weights too, or leave it out")
    if train_tokens is not None and train_tokens < 1:
        raise ValueError(f"--train-tokens {train_tokens} must be >= 1 (the mixture's tokens; leave it out for all).")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1).")
    folder = _tokenizer_folder(tokenizer)
    data = replace(DataConfig(kind="hf", tokenizer=folder), num_proc=num_proc, text_field=text_field)
    vocab = len(corpus.load_tokenizer(folder))
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    parts = [np.memmap(tokenize_source(s, data, work, dtype), dtype=dtype, mode="r") for s in sources]
    meta: dict[str, Any] = {"tokenizer": tokenizer, "vocab_size": vocab, "token_dtype": np.dtype(dtype).name}
    if sized:
        splits = size_splits([len(tokens) for tokens in parts], val_fraction, seq_len, train_tokens)
        val_fraction, meta["seq_len"] = splits.val_fraction, splits.seq_len
        if splits.global_batch_size is not None:
            meta["global_batch_size"] = splits.global_batch_size
    val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
    meta.update(write_splits(out, sources, parts, val_fraction, blend, train_tokens))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(out, DATA_MANIFEST, ["train.bin", "val.bin", "meta.json"])  # checked before data=tokens reads it
    return meta


@dataclass(frozen=True)
class Splits:
    """What a prepared corpus is written for: its validation fraction, the window (``data.seq_len``) and, when the
    corpus is too small for the default one, the global batch (``data.global_batch_size``)."""

    val_fraction: float
    seq_len: int
    global_batch_size: int | None = None


def size_splits(
    tokens: list[int], val_fraction: float | None, seq_len: int | None, train_tokens: int | None = None
) -> Splits:
    """The splits the printed command trains on as pasted, for sources of ``tokens`` tokens (a mixture of
    ``train_tokens``: that many to train on): a validation window for each of the default layout's
    :data:`VAL_WINDOWS` processes, and a batch of :data:`TRAIN_WINDOWS` training windows (data=tokens' default), else
    a smaller batch the printed command names. ``val_fraction`` / ``seq_len`` ``None``: :data:`VAL_FRACTION` raised,
    and the longest of :data:`SEQ_LENS`, that fit (one line says what was chosen).

    Raises:
        ValueError: A split too short at the given values (one line naming the value that would do).
    """
    total, fits = sum(tokens), []
    for length in [seq_len] if seq_len is not None else SEQ_LENS:
        window = length + 1
        fraction = val_fraction
        if fraction is None:  # one validation window per process: (windows + one token lost per source) of all
            fraction = max(VAL_FRACTION, _round_up((VAL_WINDOWS * window + len(tokens)) / total))
        held = sum(int(n * fraction) for n in tokens)
        train = train_tokens if train_tokens is not None else sum(n - int(n * fraction) for n in tokens)
        if held // window >= VAL_WINDOWS and train // window >= VAL_WINDOWS and fraction < 1:
            fits.append((fraction, length, train // window))
            if train // window >= TRAIN_WINDOWS:
                break
    if fits:
        fraction, length, windows = max(fits, key=lambda fit: (fit[2] >= TRAIN_WINDOWS, fit[1]))  # else the longest
        batch = None if windows >= TRAIN_WINDOWS else windows // VAL_WINDOWS * VAL_WINDOWS
        if (fraction, length) != (val_fraction, seq_len) or batch is not None:
            chosen = f" (data.global_batch_size={batch}: {windows} training windows)" if batch else ""
            print(f"sized for {total:,} tokens: --seq-len {length} --val-fraction {fraction:g}{chosen}", flush=True)
        return Splits(fraction, length, batch)
    window = (seq_len or SEQ_LENS[-1]) + 1
    if val_fraction is not None and sum(int(n * val_fraction) for n in tokens) // window < VAL_WINDOWS:
        needed = _round_up((VAL_WINDOWS * window + len(tokens)) / total)
        raise ValueError(
            f"--val-fraction {val_fraction:g} holds out {held:,} of {total:,} tokens, fewer than {VAL_WINDOWS} "
            f"windows of --seq-len {window - 1} ({window} tokens; one per process of the default layout) for "
            f"validation; use --val-fraction {needed:g}, or a smaller --seq-len."
        )
    raise ValueError(
        f"the corpus holds {total:,} tokens: fewer than {VAL_WINDOWS} training and {VAL_WINDOWS} validation windows "
        f"of --seq-len {window - 1} ({window} tokens each); "
        + ("lower --seq-len, or give more text." if seq_len is not None else "give more text.")
    )


def _round_up(fraction: float) -> float:
    """``fraction`` rounded up to two significant digits (0.03012 -> 0.031)."""
    digits = max(0, -math.floor(math.log10(fraction)) + 1)
    return math.ceil(fraction * 10**digits) / 10**digits


def train_command(out: str, meta: dict[str, Any]) -> str:
    """The ``lightning-dist-train`` command that trains on ``out`` as it is: its vocabulary for the data and the model,
    its element type, windows of its ``seq_len`` (the model's context raised to it when the default model's is
    shorter) and, for a small corpus, its global batch."""
    vocab, seq_len, batch = meta["vocab_size"], meta["seq_len"], meta.get("global_batch_size")
    command = (
        f"lightning-dist-train data=tokens data.path={out} data.token_dtype={meta['token_dtype']} "
        f"data.vocab_size={vocab} model.vocab_size={vocab} data.seq_len={seq_len}"
    )
    command += f" model.max_seq_len={seq_len}" if seq_len > GPTConfig().max_seq_len else ""
    return command + (f" data.global_batch_size={batch}" if batch else "")


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
    parser.add_argument(
        "--val-fraction",
        type=float,
        help=f"each source's last tokens held out (default {VAL_FRACTION:g}, or {VAL_WINDOWS} windows if more)",
    )
    parser.add_argument("--num-proc", type=int, help="tokenizing processes (default min(8, CPU count))")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl / .parquet records")
    parser.add_argument(
        "--seq-len",
        type=int,
        help=f"the window the printed command trains with (data.seq_len; default {SEQ_LENS[0]}, or less to fit)",
    )
    args = parser.parse_args(argv)
    if args.seq_len is not None and args.seq_len < 1:
        sys.exit(f"lightning-dist-prepare: --seq-len {args.seq_len} must be >= 1.")
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
            args.seq_len,
            sized=True,
        )
    except ValueError as err:
        sys.exit(f"lightning-dist-prepare: {err}")
    val = sum(s["val_tokens"] for s in meta["sources"])
    print(f"{args.out}: {meta['train_tokens']:,} train tokens, {val:,} validation tokens; train on them with:")
    print(train_command(args.out, meta))


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
