"""The run record a resume is checked against notes the data by its contents, not its path, and every LoRA field that
changes the model's math: the same files moved continue the run; new bytes at the old path, or another
``model.lora.alpha``, are a change that needs ``resume_allow_changes=true``."""

from __future__ import annotations

import shutil
from pathlib import Path

from helpers import FAST, compose_config

from lightning_dist.config.start import record_changes, run_record
from lightning_dist.data import contents

TEXT = "the quick brown fox jumps over the lazy dog. " * 200


def _text_run(path: Path, *more: str):
    return compose_config([*FAST, "data=text", f"data.path={path}", *more])


def test_the_same_bytes_at_a_new_path_are_the_same_data(tmp_path: Path) -> None:
    """The probe: the record compared data paths, so a corpus moved to another disk was refused."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "corpus.txt").write_text(TEXT)
    recorded = run_record(_text_run(tmp_path / "a"))
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert record_changes(recorded, run_record(_text_run(tmp_path / "b"))) == []


def test_new_bytes_at_the_old_path_are_other_data(tmp_path: Path) -> None:
    """The probe: the same path with other contents passed as the same run."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    recorded = run_record(_text_run(corpus))
    corpus.write_text(TEXT.replace("lazy", "sly!"))  # the same size: only the bytes differ
    (change,) = record_changes(recorded, run_record(_text_run(corpus)))
    assert change.startswith("the data's contents (a fingerprint of data.path's files) ")


def test_a_large_file_is_sampled_with_its_ends_and_size(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(contents, "WHOLE", 1024)
    monkeypatch.setattr(contents, "SLICE", 64)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    before = run_record(_text_run(corpus))
    corpus.write_text(TEXT[:-1] + "?")  # the last byte
    assert record_changes(before, run_record(_text_run(corpus)))
    corpus.write_text(TEXT + " ")  # one byte more
    assert record_changes(before, run_record(_text_run(corpus)))


def test_lora_alpha_changed_on_resume_is_a_change() -> None:
    """The probe: model.lora.alpha changed on resume (the adapters' scale: another model) passed silently."""
    recorded = run_record(compose_config([*FAST, "model.lora.rank=4", "model.lora.alpha=8"]))
    now = run_record(compose_config([*FAST, "model.lora.rank=4", "model.lora.alpha=16"]))
    assert record_changes(recorded, now) == ["model.lora.alpha 8.0 -> 16.0"]
    dropout = run_record(compose_config([*FAST, "model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]))
    assert record_changes(recorded, dropout) == ["model.lora.dropout 0.0 -> 0.1"]
    full = run_record(compose_config(FAST))  # no adapters: their fields do not matter
    assert record_changes(full, run_record(compose_config([*FAST, "model.lora.alpha=32"]))) == []


def test_a_record_from_before_fingerprints_compares_paths_and_nothing_it_lacks(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    now = run_record(_text_run(corpus))
    older = {k: v for k, v in now.items() if k != "data.contents" and not k.startswith("model.lora")}
    assert record_changes(older, now) == []
    moved = {**older, "data.path": str(tmp_path / "elsewhere.txt")}
    assert record_changes(moved, now) == [f"data.path {tmp_path / 'elsewhere.txt'} -> {corpus}"]
