"""lightning-dist-prepare: a corpus (files, a mixture) tokenized once into the train.bin / val.bin data=tokens reads,
each document ended by EOS, the weights giving each source's share, each source's tail held out for validation, and a
stopped run started again redoing only the sources it had not finished."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import compose_config, make_tiny_tokenizer

from lightning_dist.config.validate import validate
from lightning_dist.data import corpus
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


def test_a_weighted_mixture_is_written_as_data_tokens_reads_it(sources: list[str], tok: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    meta = prepare(sources, out, str(tok), weights=[2, 0.5], val_fraction=0.1, num_proc=2, text_field="body")
    docs, records = _stream(DOCS, tok), _stream(RECORDS, tok)
    held_docs, held_records = int(len(docs) * 0.1), int(len(records) * 0.1)
    kept_docs, kept_records = docs[: len(docs) - held_docs], records[: len(records) - held_records]
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    expected = np.concatenate([kept_docs, kept_docs, kept_records[: int(len(kept_records) * 0.5)]])
    np.testing.assert_array_equal(train, expected)  # source 1 twice, the first half of source 2
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    np.testing.assert_array_equal(val, np.concatenate([docs[len(kept_docs) :], records[len(kept_records) :]]))
    assert meta["token_dtype"] == "uint16" and [s["weight"] for s in meta["sources"]] == [2, 0.5]
    vocab = meta["vocab_size"]
    cfg = compose_config(["data=tokens", f"data.path={out}", "data.seq_len=8", f"model.vocab_size={vocab}"])
    dataset = TokenDataset(cfg.data.path, "train", cfg.data.seq_len, cfg.data.token_dtype)
    inputs, targets = dataset[0]
    assert inputs.tolist() == expected[:8].tolist() and targets.tolist() == expected[1:9].tolist()


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
    with pytest.raises(SystemExit, match=r"^lightning-dist-prepare: --weights \[1.0\]: give one positive weight per"):
        main([*sources, str(tmp_path / "out"), "--tokenizer", str(tok), "--weights", "1"])
    assert prepare_module.__doc__  # the command's help is its module docstring


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
    with pytest.raises(SystemExit, match=r"^lightning-dist-prepare: the corpus holds [\d,]+ tokens: fewer than 32 "):
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
