"""data=hf's tokenizing throughput: the whole pipeline on a cold cache against a plain ``tokenizer(batch)`` loop.

Run by hand: ``.venv/bin/python benchmarks/tokenize_throughput.py [--mb 20] [--repeat 3] [--dir /tmp/tokenize-bench]``.

- Text: ``--mb`` MB of generated English-like documents (Zipf-distributed words of a made-up lexicon, ~1 KB each) as
  JSON lines (``{"text": ...}``), written locally; nothing is downloaded.
- Tokenizer: a byte-level BPE of 8192 tokens trained on the first 2 MB of that text (``tests/helpers.py``).
- ``plain loop``: ``tokenizer(batch)["input_ids"]`` over batches of 1000 documents already in memory (the fast
  tokenizer's own threads; no reading, no EOS, no packing, nothing written).
- ``pipeline, num_proc=N``: ``hf_datasets(cfg)`` on an empty cache folder: the datasets library reads the JSON lines,
  ``datasets.map`` tokenizes in N processes (progress bar), the windows (seq_len 2048) are packed and written as
  ``.npy`` files, renamed into place. ``warm cache`` is the same call once the cache is there (what each rank does).

Each measurement runs in its own Python process (a fork after the tokenizer's threads ran would turn them off), the
imports done before its clock starts; the best of ``--repeat`` runs is shown (a shared machine is noisy). Its tokens/s
counts the tokens it produced (the pipeline's include one EOS per document).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def write_corpus(folder: Path, megabytes: float) -> Path:
    """``megabytes`` MB of ~1 KB documents as JSON lines, the same for the same size."""
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(1, 9), p=None)) for _ in range(5000)]
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    weights /= weights.sum()
    path = folder / "corpus.jsonl"
    written, target = 0, int(megabytes * 1e6)
    with path.open("w") as out:
        while written < target:
            words = [lexicon[i] for i in rng.choice(len(lexicon), size=180, p=weights)]
            sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
            line = json.dumps({"text": " ".join(sentences)}) + "\n"
            out.write(line)
            written += len(line)
    return path


def plain_loop(corpus: Path, tokenizer_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    start = time.perf_counter()
    tokens = sum(len(ids) for i in range(0, len(texts), 1000) for ids in tokenizer(texts[i : i + 1000])["input_ids"])
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def pipeline(corpus: Path, tokenizer_dir: Path, cache: Path, num_proc: int) -> dict:
    import datasets  # noqa: F401  imported before the clock starts, as the plain loop's transformers is
    import transformers  # noqa: F401

    from lightning_dist.data import DataConfig
    from lightning_dist.data.packed import hf_datasets

    cfg = DataConfig(kind="hf", path=str(corpus), tokenizer=str(tokenizer_dir), seq_len=2047, cache_dir=str(cache),
                     num_proc=num_proc, val_fraction=0.01)  # fmt: skip
    start = time.perf_counter()
    folder = hf_datasets(cfg)["train"].folder
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": json.loads((folder / "meta.json").read_text())["tokens"]}


def measure(args: list[str], repeat: int, cache: Path | None = None) -> dict:
    """The fastest of ``repeat`` runs, each in a fresh process (and on an empty ``cache`` folder when given)."""
    runs = []
    for _ in range(repeat):
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(runs, key=lambda run: run["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tokenize-bench"))
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one measurement, in this fresh process
        kind, corpus, tokenizer_dir, *rest = args.one
        if kind == "plain":
            result = plain_loop(Path(corpus), Path(tokenizer_dir))
        else:
            result = pipeline(Path(corpus), Path(tokenizer_dir), Path(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return

    from helpers import make_tiny_tokenizer

    args.dir.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(args.dir, args.mb)
    sample = [json.loads(line)["text"] for line in corpus.read_text()[:2_000_000].splitlines()[:-1]]
    tokenizer_dir = make_tiny_tokenizer(args.dir / "tokenizer", sample, vocab_size=8192)
    size_mb = corpus.stat().st_size / 1e6
    print(f"{size_mb:.1f} MB of JSON lines ({len(corpus.read_text().splitlines())} documents), BPE of 8192 tokens")
    rows = [("plain tokenizer(batch) loop", measure(["plain", str(corpus), str(tokenizer_dir)], args.repeat))]
    cache = args.dir / "cache"
    for num_proc in (1, 2):
        pipe = ["pipeline", str(corpus), str(tokenizer_dir), str(cache), str(num_proc)]
        rows.append((f"pipeline, cold cache, num_proc={num_proc}", measure(pipe, args.repeat, cache)))
    rows.append(("pipeline, warm cache (open only)", measure(pipe, args.repeat)))
    base = rows[0][1]["tokens"] / rows[0][1]["seconds"]
    print(f"{'':36} {'seconds':>8} {'tokens':>11} {'tokens/s':>11} {'vs plain':>8}")
    for name, r in rows:
        rate = r["tokens"] / r["seconds"]
        if name.startswith("pipeline, warm"):  # no tokenizing: only how long opening the cache takes
            print(f"{name:36} {r['seconds']:8.3f} {r['tokens']:11,d} {'-':>11} {'-':>8}")
        else:
            print(f"{name:36} {r['seconds']:8.2f} {r['tokens']:11,d} {rate:11,.0f} {rate / base:8.2f}")


if __name__ == "__main__":
    main()
