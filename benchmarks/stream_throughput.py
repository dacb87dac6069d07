"""data.streaming's throughput per rank: one data-parallel rank's stream on a multi-shard local corpus, with every rank
reading the whole corpus (``data.num_streams=1``, the only way before issue 47) against each reading its own shards.

Run by hand: ``.venv/bin/python benchmarks/stream_throughput.py [--shards 16] [--mb 2] [--world 8] [--windows 64]
[--repeat 3] [--before DIR] [--dir /tmp/stream-bench]``.

- Text: ``--shards`` JSON-lines files of ``--mb`` MB each of English-like documents (``tokenize_throughput.py``'s
  generator, ~1 KB each), written locally; nothing is downloaded. Tokenizer: a byte-level BPE of 8192 tokens trained
  on the first 2 MB (``tests/helpers.py``); windows of 2048 tokens (``data.seq_len=2047``).
- Each row is rank 0 of ``--world`` data-parallel ranks (``build_streamed_windows``, what a rank runs) taking
  ``--windows`` windows of its stream, timed from the first window asked to the last (the stream's set-up, datasets'
  ``load_dataset`` of the files, before the clock). ``tokens/s`` counts the tokens this rank yields (windows x 2048):
  the rate it can feed its GPU. ``MB read``: the bytes of the ``read`` system calls of the process meanwhile
  (``/proc/self/io`` ``rchar``: the files datasets reads, nothing else reads then), and per token yielded.
- ``--before DIR``: also the same rows with the package in ``DIR`` (e.g. ``git archive <commit> | tar -x -C DIR``
  of main before streams), whose ``build_streamed_windows`` takes a seed and has no ``num_streams``.

Each measurement runs in its own Python process, imports done before its clock starts; the best of ``--repeat`` runs
is shown (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def write_shards(folder: Path, shards: int, megabytes: float) -> Path:
    """``shards`` JSON-lines files of ``megabytes`` MB each under ``folder / "corpus"`` (the same for the same sizes:
    one generated text, each shard's records tagged with its number)."""
    from tokenize_throughput import write_corpus

    corpus = folder / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    missing = [shard for shard in range(shards) if not (corpus / f"part-{shard:05d}.jsonl").exists()]
    if missing:
        text = write_corpus(folder, megabytes)
        lines = text.read_text().splitlines(keepends=True)
        text.unlink()
        for shard in missing:  # {"text": ...} -> {"shard": N, "text": ...}
            (corpus / f"part-{shard:05d}.jsonl").write_text(
                "".join(f'{{"shard": {shard}, {line[1:]}' for line in lines)
            )
    return corpus


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def one(corpus: str, tokenizer: str, rank: int, world: int, streams: int, windows: int) -> dict:
    """Rank ``rank`` of ``world`` takes ``windows`` windows of its stream, in this process."""
    import datasets  # noqa: F401  imported before the clock starts
    import transformers  # noqa: F401

    from lightning_dist.data import DataConfig
    from lightning_dist.data.streaming import build_streamed_windows

    fields = {"kind": "hf", "path": corpus, "tokenizer": tokenizer, "seq_len": 2047, "streaming": True}
    if "num_streams" in DataConfig.__dataclass_fields__:
        fields["num_streams"] = streams
    elif streams != 1:
        return {"skipped": "no data.num_streams in this version"}
    cfg = DataConfig(**fields)
    if "seed" in inspect.signature(build_streamed_windows).parameters:  # before streams
        dataset = build_streamed_windows(cfg, 0, rank, world, 1)
    else:
        dataset = build_streamed_windows(cfg, rank, world, 1)
    read, start = _rchar(), time.perf_counter()
    tokens = sum(len(x) + 1 for _, (x, _) in zip(range(windows), dataset))
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "read": _rchar() - read}


def measure(code: Path, args: list[str], repeat: int) -> dict:
    """The fastest of ``repeat`` runs, each in a fresh process with the package in ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code), "TOKENIZERS_PARALLELISM": "true"}
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, __file__, "--one", *args], capture_output=True, text=True, check=True, env=env
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if "skipped" in runs[-1]:
            return runs[-1]
    return min(runs, key=lambda run: run["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--mb", type=float, default=2.0, help="MB per shard")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--windows", type=int, default=64, help="windows rank 0 takes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="the package before streams, for its rows")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/stream-bench"))
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one measurement, in this fresh process
        corpus, tokenizer, *numbers = args.one
        print(json.dumps(one(corpus, tokenizer, *map(int, numbers))))
        return

    from helpers import make_tiny_tokenizer

    corpus = write_shards(args.dir, args.shards, args.mb)
    first = next(corpus.iterdir()).read_text()[:2_000_000].splitlines()[:-1]
    tokenizer = make_tiny_tokenizer(args.dir / "tokenizer", [json.loads(line)["text"] for line in first], 8192)
    size = sum(f.stat().st_size for f in corpus.iterdir())
    print(
        f"{args.shards} shards, {size / 1e6:.1f} MB of JSON lines; rank 0 of {args.world} takes {args.windows} windows"
    )
    rows = []
    code = [("before", args.before)] if args.before else []
    for label, package in [*code, ("now", ROOT)]:
        for world, streams in ((1, 1), (args.world, 1), (args.world, args.world), (args.world, 2 * args.world)):
            row = [str(corpus), str(tokenizer), "0", str(world), str(streams), str(args.windows)]
            rows.append((f"{label}: dp={world} num_streams={streams}", measure(package, row, args.repeat)))
    print(f"{'':34} {'seconds':>8} {'tokens':>10} {'tokens/s':>10} {'MB read':>8} {'bytes/token':>11}")
    for name, r in rows:
        if "skipped" in r:
            print(f"{name:34} {r['skipped']}")
            continue
        rate = r["tokens"] / r["seconds"]
        print(
            f"{name:34} {r['seconds']:8.2f} {r['tokens']:10,d} {rate:10,.0f} {r['read'] / 1e6:8.1f} "
            f"{r['read'] / r['tokens']:11.1f}"
        )


if __name__ == "__main__":
    main()
