"""``lightning-dist-prepare SOURCE... --tokenizer T OUT``: a corpus tokenized once into the ``train.bin`` /
``val.bin`` that ``data=tokens`` reads.

Each source is a file, a folder or a glob of ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files (as ``data=hf``
reads them), or a hub dataset id (``org/name``, downloaded into the HuggingFace cache as ``data.path`` is). Its
documents are tokenized by datasets' ``map`` in ``--num-proc`` processes with its progress bar (the same batched
function as ``data=hf``: each document ended by EOS), and its tokens written to ``OUT/.work/<source>.bin``.

**A mixture**: ``--weights 3 1`` gives each source's tokens that many times (a fraction takes the first part of its
tokens: 0.5 = the first half), written one after the other; ``data=tokens`` shuffles its windows, so every batch draws
from the sources in those proportions. The last ``--val-fraction`` of each source's tokens (before weighting) goes to
``val.bin``, so validation measures each source in its own proportion and never a window trained on.

**Resumable**: a source's ``.bin`` is written under a temporary name and renamed when whole, so a stopped run, started
again with the same arguments, skips the sources it finished (their names hash the source's files, sizes and
modification times, the tokenizer and the text field); datasets keeps the tokenized Arrow files of a finished ``map``
in ``OUT/.work/datasets``. ``OUT/meta.json`` says what was written: the tokenizer, the vocabulary, the element type
(``data.token_dtype``: uint16 up to 65,536 tokens, else uint32) and each source's tokens.

Examples::

    lightning-dist-prepare input.txt --tokenizer gpt2-tokenizer/ tokens/
    lightning-dist-prepare web/*.parquet HuggingFaceFW/fineweb-edu --weights 1 3 \\
        --tokenizer meta-llama/Llama-3.1-8B out/
    lightning-dist-train cluster=gpu model=llama_1b data=tokens data.path=out/ data.token_dtype=uint32 \\
        data.vocab_size=128256 model.vocab_size=128256 data.seq_len=2048

It ends by printing the ``lightning-dist-train`` command that trains on OUT as it is (its vocabulary, element type
and ``--seq-len`` windows). The splits are sized for it before anything is written: a batch of training windows and
a validation window for each process of the default layout; ``--seq-len`` and ``--val-fraction``, when not given,
are chosen to fit a small corpus (one line says so), and given values that do not fit are refused in one line
naming what would.
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
from lightning_dist.data.config import DataConfig
from lightning_dist.hub import hub_snapshot, looks_like_hub_id
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


def prepare(
    sources: list[str],
    out: Path,
    tokenizer: str,
    weights: list[float] | None = None,
    val_fraction: float | None = VAL_FRACTION,
    num_proc: int | None = None,
    text_field: str = "text",
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
    weights = list(weights) if weights else [1.0] * len(sources)
    if len(weights) != len(sources) or any(w <= 0 for w in weights):
        raise ValueError(f"--weights {weights}: give one positive weight per source ({len(sources)} sources).")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1).")
    folder = _tokenizer_folder(tokenizer)
    data = replace(DataConfig(kind="hf", tokenizer=folder), num_proc=num_proc, text_field=text_field)
    vocab = len(corpus.load_tokenizer(folder))
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    parts = [np.memmap(tokenize_source(s, data, work, dtype), dtype=dtype, mode="r") for s in sources]
    meta: dict[str, Any] = {
        "tokenizer": tokenizer,
        "vocab_size": vocab,
        "token_dtype": np.dtype(dtype).name,
        "sources": [],
    }
    if sized:
        splits = size_splits([len(tokens) for tokens in parts], weights, val_fraction, seq_len)
        val_fraction, meta["seq_len"] = splits.val_fraction, splits.seq_len
    val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
    with (out / "train.bin.partial").open("wb") as train, (out / "val.bin.partial").open("wb") as val:
        for source, weight, tokens in zip(sources, weights, parts):
            held = int(len(tokens) * val_fraction)
            kept = tokens[: len(tokens) - held]
            val.write(np.asarray(tokens[len(kept) :]).tobytes())
            for _ in range(int(weight)):
                train.write(np.asarray(kept).tobytes())
            train.write(np.asarray(kept[: int(len(kept) * (weight % 1))]).tobytes())
            meta["sources"].append(
                {
                    "source": source,
                    "weight": weight,
                    "tokens": len(tokens),
                    "train_tokens": int(len(kept) * weight),
                    "val_tokens": held,
                }
            )
    for name in ("train.bin", "val.bin"):
        os.replace(out / f"{name}.partial", out / name)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


@dataclass(frozen=True)
class Splits:
    """The validation fraction and the window (``data.seq_len``) a prepared corpus is written for."""

    val_fraction: float
    seq_len: int


def size_splits(tokens: list[int], weights: list[float], val_fraction: float | None, seq_len: int | None) -> Splits:
    """The splits that the printed command trains on as pasted (the default config: a batch of
    :data:`TRAIN_WINDOWS` windows, validation on each of :data:`VAL_WINDOWS` processes), for sources of ``tokens``
    tokens given these ``weights``. ``val_fraction`` / ``seq_len`` ``None``: :data:`VAL_FRACTION` raised, and the
    longest of :data:`SEQ_LENS`, that fit (one line says what was chosen).

    Raises:
        ValueError: A split too short at the given values (one line naming the value that would do).
    """
    total = sum(tokens)
    for length in [seq_len] if seq_len is not None else SEQ_LENS:
        window = length + 1
        fraction = val_fraction
        if fraction is None:  # one validation window per process: (windows + one token lost per source) of all
            fraction = max(VAL_FRACTION, _round_up((VAL_WINDOWS * window + len(tokens)) / total))
        held = sum(int(n * fraction) for n in tokens)
        train = sum(int((n - int(n * fraction)) * w) for n, w in zip(tokens, weights))
        if held // window >= VAL_WINDOWS and train // window >= TRAIN_WINDOWS and fraction < 1:
            if (fraction, length) != (val_fraction, seq_len):
                print(f"sized for {total:,} tokens: --seq-len {length} --val-fraction {fraction:g}", flush=True)
            return Splits(fraction, length)
    if held // window < VAL_WINDOWS and val_fraction is not None and seq_len is not None:
        needed = _round_up((VAL_WINDOWS * window + len(tokens)) / total)
        raise ValueError(
            f"--val-fraction {val_fraction:g} holds out {held:,} of {total:,} tokens, fewer than {VAL_WINDOWS} "
            f"windows of --seq-len {length} ({window} tokens; one per process of the default layout) for validation; "
            f"use --val-fraction {needed:g}, or a smaller --seq-len."
        )
    raise ValueError(
        f"the corpus holds {total:,} tokens: fewer than {TRAIN_WINDOWS} training windows (data=tokens' batch) and "
        f"{VAL_WINDOWS} validation windows of --seq-len {length} ({window} tokens each); "
        + ("lower --seq-len, or give more text." if seq_len is not None else "give more text.")
    )


def _round_up(fraction: float) -> float:
    """``fraction`` rounded up to two significant digits (0.03012 -> 0.031)."""
    digits = max(0, -math.floor(math.log10(fraction)) + 1)
    return math.ceil(fraction * 10**digits) / 10**digits


def train_command(out: str, meta: dict[str, Any], seq_len: int) -> str:
    """The ``lightning-dist-train`` command that trains on ``out`` as it is: its vocabulary for the data and the model,
    its element type, and windows of ``seq_len`` (the model's context raised to it when the default model's is
    shorter)."""
    vocab = meta["vocab_size"]
    command = (
        f"lightning-dist-train data=tokens data.path={out} data.token_dtype={meta['token_dtype']} "
        f"data.vocab_size={vocab} model.vocab_size={vocab} data.seq_len={seq_len}"
    )
    return command + (f" model.max_seq_len={seq_len}" if seq_len > GPTConfig().max_seq_len else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="files, a folder, a glob, or a hub dataset id")
    parser.add_argument("out", metavar="OUT", help="the folder data=tokens reads (data.path=OUT)")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer (or model) folder, or a hub model id")
    parser.add_argument("--weights", nargs="+", type=float, help="each source's share: its tokens this many times")
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
            args.tokenizer,
            args.weights,
            args.val_fraction,
            args.num_proc,
            args.text_field,
            args.seq_len,
            sized=True,
        )
    except ValueError as err:
        sys.exit(f"lightning-dist-prepare: {err}")
    train = sum(s["train_tokens"] for s in meta["sources"])
    val = sum(s["val_tokens"] for s in meta["sources"])
    print(f"{args.out}: {train:,} train tokens, {val:,} validation tokens; train on them with:")
    print(train_command(args.out, meta, meta["seq_len"]))


if __name__ == "__main__":
    main()
