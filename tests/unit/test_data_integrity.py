"""Tokenized data the project wrote is covered by a manifest (each file's size and CRC-32) and checked before a run
reads it: ``lightning-dist-prepare``'s ``OUT`` (``data=tokens``) and a ``data=hf`` cache. A flipped, truncated or
removed file stops the run before launch with one line naming it and the fix; a folder of another tool (nanoGPT's
``prepare.py``) has no manifest and is read as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from helpers import compose_config, make_tiny_tokenizer

from lightning_dist.config.validate import validate
from lightning_dist.manifest import DATA_MANIFEST
from lightning_dist.run.prepare import prepare

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(40)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), DOCS, chat_template=None)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    return folder


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tokens_run(out: Path) -> list[str]:
    sizes = ["data.seq_len=8", "data.global_batch_size=4", "data.vocab_size=300", "model.vocab_size=300"]
    return ["logger=none", "data=tokens", f"data.path={out}", *sizes]


def test_prepared_tokens_are_checked_before_a_run_reads_them(corpus: Path, tok: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokens"
    prepare([str(corpus)], out, str(tok), val_fraction=0.2, num_proc=1)
    manifest = json.loads((out / DATA_MANIFEST).read_text())
    assert set(manifest["files"]) == {"train.bin", "val.bin", "meta.json"}  # not the work folder
    validate(compose_config(_tokens_run(out)))  # whole: fine
    _flip(out / "train.bin", 10)  # a token id changed (still within the vocabulary: no other check sees it)
    with pytest.raises(ValueError) as refused:
        validate(compose_config(_tokens_run(out)))
    assert str(refused.value) == (
        f"data.path={out} is damaged (train.bin does not match the CRC-32 written with it (its bytes changed)); "
        "write it again with lightning-dist-prepare (its meta.json names the sources and tokenizer)."
    )
    (out / "val.bin").write_bytes((out / "val.bin").read_bytes()[:-2])  # one token short
    with pytest.raises(ValueError, match=r"is damaged \(val.bin has \d+ bytes, not the \d+ written"):
        validate(compose_config(_tokens_run(out)))


def test_tokens_of_another_tool_have_no_manifest_and_are_read_as_before(tmp_path: Path) -> None:
    out = tmp_path / "nanogpt"
    out.mkdir()
    for split in ("train", "val"):
        np.arange(200, dtype=np.uint16).tofile(out / f"{split}.bin")
    validate(compose_config(_tokens_run(out)))


def _hf_run(corpus: Path, tok: Path, cache: Path) -> list[str]:
    sizes = ["data.seq_len=8", "data.global_batch_size=4", "data.num_proc=1", "model.vocab_size=512"]
    return ["logger=none", "data=hf", f"data.path={corpus}", f"data.cache_dir={cache}", f"data.tokenizer={tok}", *sizes]


@pytest.mark.parametrize("damage", ["flipped", "manifest removed"])
def test_a_damaged_hf_cache_is_refused_before_launch(damage: str, corpus: Path, tok: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    validate(compose_config(_hf_run(corpus, tok, cache)))  # builds the cache
    (folder,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert set(json.loads((folder / DATA_MANIFEST).read_text())["files"]) == {"tokens.npy", "windows.npy", "meta.json"}
    if damage == "flipped":
        _flip(folder / "tokens.npy", (folder / "tokens.npy").stat().st_size - 3)
        problem = "tokens.npy does not match the CRC-32 written with it (its bytes changed)"
    else:
        (folder / DATA_MANIFEST).unlink()
        problem = f"its {DATA_MANIFEST} is missing"
    with pytest.raises(ValueError) as refused:
        validate(compose_config(_hf_run(corpus, tok, cache)))
    assert str(refused.value) == (
        f"the data=hf cache {folder} is damaged ({problem}); remove it (rm -r {folder}) and the next run tokenizes "
        "the data again."
    )
