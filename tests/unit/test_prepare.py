"""lightning-dist-prepare: a corpus (files, a mixture) tokenized once into the train.bin / val.bin data=tokens reads,
each document ended by EOS, the weights giving each source's share, each source's tail held out for validation, and a
stopped run started again redoing only the sources it had not finished."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import compose_config, make_tiny_tokenizer

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
