"""lightning-dist-prepare: a corpus (files, a mixture) tokenized once into the train.bin / val.bin data=tokens reads,
each document ended by EOS, each source written once and a mixture read by index (the weights each source's share of
the windows), each source's tail held out for validation, a capped source read only until its cap, a tokenizer trained
on the corpus when asked, and a stopped run started again redoing only the sources it had not finished."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import compose_config, make_tiny_tokenizer

from lightning_dist.config.validate import validate
from lightning_dist.data import corpus
from lightning_dist.data.blend import Blend
from lightning_dist.data.files import TokenDataset
from lightning_dist.run import prepare as prepare_module
from lightning_dist.run.prepare import main, prepare

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(12)]
RECORDS = [f"record {i}: a second source, of other words entirely, number {i}." for i in range(8)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), DOCS + RECORDS, chat_template=None)


@pytest.fixture
def sources(tmp_path: Path) -> list[str]:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"body": text}) + "\n" for text in RECORDS))
    return [str(folder), str(records)]


def _stream(texts: list[str], tok: Path) -> np.ndarray:
    tokenizer = corpus.load_tokenizer(str(tok))
    return np.array([t for text in texts for t in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]])


def test_a_weighted_mixture_is_written_once_and_data_tokens_reads_it_by_index(
    sources: list[str], tok: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    meta = prepare(sources, out, str(tok), weights=[0.5, 1], val_fraction=0.1, num_proc=2, text_field="body")
    docs, records = _stream(DOCS, tok), _stream(RECORDS, tok)
    held_docs, held_records = int(len(docs) * 0.1), int(len(records) * 0.1)
    kept_docs, kept_records = docs[: len(docs) - held_docs], records[: len(records) - held_records]
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    np.testing.assert_array_equal(train, np.concatenate([kept_docs, kept_records]))  # each source once, no copies
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    np.testing.assert_array_equal(val, np.concatenate([docs[len(kept_docs) :], records[len(kept_records) :]]))
    assert meta["token_dtype"] == "uint16" and [s["share"] for s in meta["sources"]] == [1, 2]
    assert meta["blend"] == {"shares": [1, 2], "train_tokens": len(train)}
    cfg = compose_config(
        ["data=tokens", f"data.path={out}", "data.seq_len=8", f"model.vocab_size={meta['vocab_size']}"]
    )
    dataset = TokenDataset(cfg.data.path, "train", cfg.data.seq_len, cfg.data.token_dtype)
    own = [np.array(tokens[: len(tokens) // 9 * 9]).reshape(-1, 9).tolist() for tokens in (kept_docs, kept_records)]
    assert len(dataset) == len(train) // 9  # the mixture's tokens: the sources' (no --train-tokens)
    source, _ = Blend([0.5, 1]).index(len(dataset))
    windows = [torch.cat([x, y[-1:]]).tolist() for x, y in (dataset[i] for i in range(len(dataset)))]
    for window, j in zip(windows, source):
        assert window in own[j]  # one source's own window, as the blend's index says
    taken = [sum(1 for w, j in zip(windows, source) if j == k) for k in (0, 1)]
    assert taken == Blend([1, 2]).counts(len(dataset)) and taken[0] < len(own[0]) and taken[1] > len(own[1])
    docs_used = [windows.count(w) for w in own[0]]
    assert max(docs_used) == 1 and docs_used[0] == docs_used[-1] == 1  # fewer than it has: each once, spread out
    repeats = [windows.count(w) for w in own[1]]
    assert min(repeats) >= 1 and max(repeats) - min(repeats) <= 1  # more: every window, as often as the others to one


def test_a_mixture_s_tokens_are_set_and_a_capped_source_is_the_first_of_its_tokens(
    sources: list[str], tok: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    capped = f"{sources[1]}?max_tokens=37"
    kwargs = {"weights": [1, 1], "val_fraction": 0, "num_proc": 1, "text_field": "body", "train_tokens": 900}
    meta = prepare([sources[0], capped], out, str(tok), **kwargs)
    records = _stream(RECORDS, tok)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    np.testing.assert_array_equal(train[-37:], records[:37])  # read (streamed) only until the cap, the rest never
    assert [s["tokens"] for s in meta["sources"]][1] == 37 and meta["train_tokens"] == 900
    dataset = TokenDataset(str(out), "train", 8, "uint16")
    assert len(dataset) == 900 // 9 == 100  # 50 windows of each, records' 4 windows each taken 12 or 13 times


def test_a_stopped_run_started_again_tokenizes_only_what_it_had_not_finished(
    sources: list[str], tok: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    tokenized: list[int] = []
    real = corpus.tokenize

    def tokenize(records, tokenizer, data, fingerprint):
        tokenized.append(len(records))
        if len(tokenized) == 2 and stop:
            raise KeyboardInterrupt  # stopped while tokenizing the second source
        return real(records, tokenizer, data, fingerprint)

    monkeypatch.setattr(corpus, "tokenize", tokenize)
    stop = True
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, out, str(tok), num_proc=1, text_field="body")
    assert not (out / "train.bin").exists() and tokenized == [len(DOCS), len(RECORDS)]
    stop = False
    prepare(sources, out, str(tok), val_fraction=0, num_proc=1, text_field="body")
    assert tokenized == [len(DOCS), len(RECORDS), len(RECORDS)]  # the first source was not tokenized again
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    np.testing.assert_array_equal(train, np.concatenate([_stream(DOCS, tok), _stream(RECORDS, tok)]))


def test_bad_arguments_are_one_line(sources: list[str], tok: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match=r"^lightning-dist-prepare: --weights \[1.0\]: give one positive weight per"):
        main([*sources, out, "--tokenizer", str(tok), "--weights", "1"])
    with pytest.raises(SystemExit, match=r"^lightning-dist-prepare: SOURCE=.*\?max_tokens=lots: max_tokens='lots' is "):
        main([sources[0], f"{sources[1]}?max_tokens=lots", out, "--tokenizer", str(tok)])
    with pytest.raises(
        SystemExit, match=r"^lightning-dist-prepare: --train-tokens 100 sizes a mixture; give --weights"
    ):
        main([*sources, out, "--tokenizer", str(tok), "--train-tokens", "100"])
    too_small = r"^lightning-dist-prepare: --train-tokenizer 200: a byte-level BPE holds the 256 bytes and <\|endof"
    with pytest.raises(SystemExit, match=too_small):
        main([*sources, out, "--train-tokenizer", "200"])
    no_field = r"^lightning-dist-prepare: SOURCE=.*: its records have no 'text' field \(they have body\); pass --text"
    with pytest.raises(SystemExit, match=no_field):
        main([f"{sources[1]}?max_tokens=9", out, "--tokenizer", str(tok)])
    with pytest.raises(SystemExit) as err:  # argparse: one of the two, not both (its usage line, exit 2)
        main([*sources, out, "--tokenizer", str(tok), "--train-tokenizer", "300"])
    assert err.value.code == 2
    assert prepare_module.__doc__  # the command's help is its module docstring


def test_a_tokenizer_trained_on_the_corpus_tokenizes_it_and_a_model_trains_on_its_tokens(
    sources: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from transformers import AutoTokenizer

    from lightning_dist.data.tokenizer_training import train_tokenizer

    out = tmp_path / "out"
    main([*sources, str(out), "--train-tokenizer", "300", "--text-field", "body", "--val-fraction", "0.1"])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    folder = out / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) <= 300 and tokenizer.eos_token == "<|endoftext|>"
    for text in [*DOCS, *RECORDS, "unseen: ünïcödé, emoji 🙂 and tabs\t."]:  # byte-level: any text round-trips
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer("document 3: the quick brown fox")["input_ids"]) < 12  # merges learnt from the corpus
    again = train_tokenizer(sources, tmp_path / "again", 300, text_field="body")  # the same text: the same bytes
    assert (again / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    docs = _stream(DOCS, folder)
    np.testing.assert_array_equal(train[: len(docs) - int(len(docs) * 0.1)], docs[: len(docs) - int(len(docs) * 0.1)])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == len(tokenizer) and f"model.vocab_size={len(tokenizer)}" in printed
    # What the printed command sets (issue 44 prints it whole and checks that it trains as pasted).
    overrides = ["data=tokens", f"data.path={out}", f"data.token_dtype={meta['token_dtype']}"]
    overrides += [f"data.vocab_size={meta['vocab_size']}", f"model.vocab_size={meta['vocab_size']}"]
    from helpers import FAST, losses, run_app

    result = run_app([*FAST, *overrides, "trainer.max_steps=2", "data.seq_len=16"], tmp_path / "run")
    assert len(losses(result)) == 2 and all(np.isfinite(losses(result)))


def test_a_source_s_options_are_read_and_a_glob_s_wildcard_is_not_one(tmp_path: Path) -> None:
    from lightning_dist.data.sources import parse_source

    spec = parse_source("org/web@v2?name=sample-10BT&split=test&data_files=a/*.parquet&data_files=b/*&max_tokens=2.5B")
    assert (spec.location, spec.name, spec.split) == ("org/web@v2", "sample-10BT", "test")
    assert spec.data_files == ("a/*.parquet", "b/*")
    assert spec.max_tokens == 2_500_000_000 and spec.hub == ("org/web", "v2") and spec.selects
    assert parse_source("org/web?max_tokens=1_000").max_tokens == 1000
    glob = parse_source(str(tmp_path / "part-??.jsonl"))  # ? of a glob: the location's own
    assert glob.location == str(tmp_path / "part-??.jsonl") and glob.hub is None and not glob.selects
    for bad, message in [
        ("org/web?max_tokens=0", r"max_tokens='0' is not a positive count"),
        ("org/web?max_tokens=1.5", r"max_tokens='1.5' is not a positive count"),
        ("org/web?name=a&name=b", r"name is given 2 times; give it once"),
        ("org/web?colour=red", r"unknown option 'colour'; use name, split, data_files, max_tokens"),
        (f"{tmp_path}?split=test", r"name, split and data_files select a part of a hub dataset, and .* is local"),
    ]:
        with pytest.raises(ValueError, match=rf"^SOURCE={bad[:8]}.*: {message}"):
            parse_source(bad)


CHATS = "\n".join(f"User: what is {i} plus {i + 1}?\nAssistant: {i} plus {i + 1} is {2 * i + 1}." for i in range(200))


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A newcomer's corpus: 200 chats in one .txt (one document), and a BPE tokenizer of 300 tokens trained on it."""
    root = tmp_path_factory.mktemp("chats")
    (root / "chats.txt").write_text(CHATS)
    return root / "chats.txt", make_tiny_tokenizer(root / "tok", CHATS.splitlines(), chat_template=None)


def _printed_command(argv: list[str], capsys: pytest.CaptureFixture) -> list[str]:
    capsys.readouterr()
    main(argv)
    command = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert command[0] == "lightning-dist-train"
    return command[1:]


def test_the_printed_command_trains_as_pasted(
    chats: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Pasted, it was refused three times (data.vocab_size=50304 over the model's 300; data.seq_len=1024 over the
    default model's 256; a val.bin of 1 token): the command names the corpus's vocabulary for the data and the model,
    and its splits are sized before anything is written. Checked as the launcher checks it before any rank starts
    (every file read, every split against the default layout's batch and processes)."""
    text, tok = chats
    overrides = _printed_command([str(text), str(tmp_path / "out"), "--tokenizer", str(tok)], capsys)
    valid = validate(compose_config(overrides, tmp_path / "run"))
    assert valid.cfg.data.vocab_size == valid.cfg.model.vocab_size == len(corpus.load_tokenizer(str(tok)))
    windows = (tmp_path / "out" / "val.bin").stat().st_size // 2 // (valid.cfg.data.seq_len + 1)
    assert windows >= valid.dims.dp_size == 2  # the default layout validates a window on each process
    assert "data.global_batch_size" not in overrides  # data=tokens' batch of 32 windows fits


def test_a_corpus_too_small_for_the_default_batch_gets_a_command_with_its_own(
    sources: list[str], tok: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = _printed_command([sources[0], str(tmp_path / "out"), "--tokenizer", str(tok)], capsys)
    batch = next(int(o.split("=")[1]) for o in overrides if o.startswith("data.global_batch_size="))
    assert 2 <= batch < 32 and batch % 2 == 0
    validate(compose_config(overrides, tmp_path / "run"))


def test_values_that_do_not_fit_are_refused_before_anything_is_written_naming_what_would(
    chats: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text, tok = chats
    args = [str(text), str(tmp_path / "out"), "--tokenizer", str(tok), "--seq-len", "64"]
    with pytest.raises(SystemExit) as refused:
        main([*args, "--val-fraction", "0.0005"])
    message = str(refused.value.code)
    expected = (
        r"^lightning-dist-prepare: --val-fraction 0.0005 holds out \d+ of [\d,]+ tokens, fewer than 2 windows of "
        r"--seq-len 64 .* use --val-fraction [\d.]+, or a smaller --seq-len\.$"
    )
    assert re.match(expected, message), message
    assert not (tmp_path / "out" / "train.bin").exists() and not (tmp_path / "out" / "val.bin").exists()
    fraction = re.search(r"use --val-fraction ([\d.]+)", message).group(1)
    overrides = _printed_command([*args, "--val-fraction", fraction], capsys)  # the value it named does
    assert "data.seq_len=64" in overrides
    validate(compose_config(overrides, tmp_path / "run"))
    with pytest.raises(SystemExit, match=r"^lightning-dist-prepare: the corpus holds [\d,]+ tokens: fewer than 2 "):
        main([*args[:-1], "100000"])


def test_a_validation_split_shorter_than_the_data_parallel_size_is_refused_before_launch(tmp_path: Path) -> None:
    """It was found on the ranks, after they started (rank 0: val split has 1 samples ...)."""
    (tmp_path / "train.bin").write_bytes(np.arange(40 * 9, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(9, dtype=np.uint16).tobytes())  # one window of seq_len 8
    tokens = ["data=tokens", f"data.path={tmp_path}", "data.seq_len=8", "data.vocab_size=512", "model.vocab_size=512"]
    with pytest.raises(ValueError, match=r"^val split has 1 samples, fewer than the data-parallel size 2"):
        validate(compose_config(tokens, tmp_path / "run"))
    validate(compose_config([*tokens, "cluster.devices=1"], tmp_path / "run1"))
    validate(compose_config([*tokens, "trainer.limit_val_batches=0"], tmp_path / "run2"))  # no validation: no need
