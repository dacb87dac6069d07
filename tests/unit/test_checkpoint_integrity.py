"""Every published checkpoint carries a manifest (each file's size and CRC-32); a checkpoint whose bytes were damaged
after it was written is found before it is loaded, named by its file, and passed over for the newest whole one.

The checkpoints here are real: DCP folders written by :func:`lightning_dist.checkpoint.store.save` (no process group)
and published by :class:`RunCheckpoints`, and a ``torch.save`` archive; the damage is done to their bytes.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.checkpoint import store
from lightning_dist.checkpoint.folder import MANIFEST, merge_parts, parts_written, write_part
from lightning_dist.manifest import crc32_of

SHARD, META = "__0_0.distcp", "meta.pt"


def _publish(dirpath: Path, steps: list[int]) -> list[Path]:
    """Checkpoints of ``steps`` published by RunCheckpoints, each a real DCP folder of one rank."""

    def save_checkpoint(path: Path, **kwargs: Any) -> None:
        state = {"state_dict": {"w": torch.full((128, 128), float(trainer.global_step))}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: no process group, one process
            store.save(state, {"global_step": trainer.global_step}, path, global_rank=0)

    strategy = SimpleNamespace(barrier=lambda: None, broadcast=lambda value: value)
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, strategy=strategy, save_checkpoint=save_checkpoint)
    saver = RunCheckpoints(dirpath, keep_last=len(steps))
    for step in steps:
        trainer.global_step = step
        saver.save(trainer)
        saver.on_train_batch_start(trainer, None)  # the next step boundary: published
    return [dirpath / f"step-{step:08d}" for step in steps]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "a flipped byte in a shard": (lambda ckpt: _flip_byte(ckpt / SHARD, 5000), rf"{SHARD} does not match the CRC-32"),
    "a truncated shard": (lambda ckpt: _truncate(ckpt / SHARD), rf"{SHARD} has \d+ bytes, not the \d+ written"),
    "a missing shard": (lambda ckpt: (ckpt / SHARD).unlink(), rf"{SHARD} is missing"),
    "a truncated meta.pt": (lambda ckpt: _truncate(ckpt / META), rf"{META} has \d+ bytes, not the \d+ written"),
    "a truncated .metadata": (lambda ckpt: _truncate(ckpt / ".metadata"), r"\.metadata has \d+ bytes, not the"),
}


def test_a_published_checkpoint_has_a_manifest_of_every_file(tmp_path: Path) -> None:
    (checkpoint,) = _publish(tmp_path, [3])
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    names = {".metadata", SHARD, META}
    assert set(manifest["files"]) == names  # and no part or temporary file is left
    assert {p.name for p in checkpoint.iterdir()} == names | {MANIFEST}
    for name in names:
        entry = manifest["files"][name]
        assert entry == {"size": (checkpoint / name).stat().st_size, "crc32": crc32_of(checkpoint / name)}
    assert store.damage(checkpoint) is None and store.unchecked_note(checkpoint) is None


@pytest.mark.parametrize("case", DAMAGE, ids=str)
def test_a_damaged_checkpoint_is_named_by_its_file_and_passed_over(case: str, tmp_path: Path) -> None:
    older, newest = _publish(tmp_path, [3, 6])
    damage, message = DAMAGE[case]
    damage(newest)
    skipped: list[tuple[Path, str]] = []
    assert store.latest_checkpoint(tmp_path, skipped=skipped) == older  # the `latest` file names the damaged one
    assert [path for path, _ in skipped] == [newest]
    assert re.search(message, skipped[0][1]), skipped
    with pytest.raises(ValueError, match=rf"checkpoint {newest} cannot be loaded \({message}.*; the newest whole "
                                         rf"checkpoint there is {older}\.$"):  # fmt: skip
        store.check_loadable(newest)


def test_sizes_only_misses_a_changed_byte_but_not_a_truncation(tmp_path: Path) -> None:
    (checkpoint,) = _publish(tmp_path, [3])
    _flip_byte(checkpoint / SHARD, 5000)
    assert store.damage(checkpoint, checksums=False) is None  # checkpoint.verify=sizes: what it costs to skip
    assert "does not match the CRC-32" in store.damage(checkpoint)
    _truncate(checkpoint / SHARD)
    assert "not the" in store.damage(checkpoint, checksums=False)


def test_a_checkpoint_without_a_manifest_loads_after_a_size_check_with_one_note(tmp_path: Path) -> None:
    """Written before manifests existed: its shard sizes are checked against DCP's own index."""
    older, newest = _publish(tmp_path, [3, 6])
    for checkpoint in (older, newest):
        (checkpoint / MANIFEST).unlink()
    assert store.damage(newest) is None
    assert store.unchecked_note(newest) == (
        f"checkpoint {newest} has no {MANIFEST} (written before checkpoints had one): only its files' sizes were "
        "checked, not their contents"
    )
    full = (newest / SHARD).stat().st_size
    _truncate(newest / SHARD)
    assert store.damage(newest) == f"{SHARD} has {full // 2} bytes, fewer than the {full} its .metadata indexes " + (
        "(truncated?)"
    )
    _truncate(older / ".metadata")
    assert store.damage(older) == ".metadata cannot be read (truncated?)"
    assert store.latest_checkpoint(tmp_path) is None


def test_a_single_file_checkpoint_is_checked_by_its_archives_crcs(tmp_path: Path) -> None:
    """Lightning's own ``.ckpt`` (one process, ``parallelism=ddp``) is a zip archive that keeps a CRC-32 per member."""
    path = tmp_path / "step-00000004"
    torch.save({"state_dict": {"w": torch.randn(128, 128)}}, path)
    assert store.damage(path) is None
    _flip_byte(path, path.stat().st_size // 2)
    assert "does not match the CRC-32 the archive keeps" in store.damage(path)
    assert store.damage(path, checksums=False) is None


def test_the_manifest_covers_every_ranks_files(tmp_path: Path) -> None:
    """Each rank hashes the shards it wrote; rank 0 takes the rest, and hashes a file no part named."""
    folder = tmp_path / ".step-00000002.partial"
    folder.mkdir()
    for name, size in {"__0_0.distcp": 10, "__1_0.distcp": 20, "__1_1.distcp": 5, ".metadata": 7, META: 3}.items():
        (folder / name).write_bytes(bytes(range(size)))
    write_part(folder, 1)
    assert not parts_written(folder, 2)  # rank 0's part not yet there: an async save is not published yet
    assert set(json.loads((folder / ".manifest-1.json").read_text())) == {"__1_0.distcp", "__1_1.distcp"}
    write_part(folder, 0)
    assert set(json.loads((folder / ".manifest-0.json").read_text())) == {"__0_0.distcp", ".metadata", META}
    (folder / "__2_0.distcp").write_bytes(b"written by a rank that wrote no part")
    assert parts_written(folder, 2)
    merge_parts(folder)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert set(files) == {"__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__2_0.distcp", ".metadata", META}
    assert not list(folder.glob(".manifest-*"))


def test_an_async_save_is_hashed_off_the_step_and_published_once_every_rank_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint.async_save``: this rank hashes its files in a thread of the callback's once its write is done (never
    in the training step), and rank 0 publishes only when every rank's part of the manifest is there."""
    import threading
    import time
    from concurrent.futures import Future

    from lightning_dist.callbacks import checkpoints
    from lightning_dist.contract import VIEW_MEMBERS

    hashed_in: list[str] = []

    def recording(folder: Path, rank: int) -> None:
        hashed_in.append(threading.current_thread().name)
        write_part(folder, rank)

    monkeypatch.setattr(checkpoints, "write_part", recording)
    write = Future()  # DCP's background write, done when the test says so

    def save_checkpoint(path: Path, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store.save({"state_dict": {"w": torch.ones(64, 64)}}, {}, path, global_rank=0)
        strategy.pending_save = write

    strategy = SimpleNamespace(**dict.fromkeys(VIEW_MEMBERS), barrier=lambda: None, broadcast=lambda value: value)
    trainer = SimpleNamespace(global_step=2, global_rank=0, world_size=2, is_global_zero=True, strategy=strategy,
                              save_checkpoint=save_checkpoint)  # fmt: skip
    saver = RunCheckpoints(tmp_path, every_n_steps=100)
    partial = saver.save(trainer).with_name(".step-00000002.partial")
    assert hashed_in == [] and saver.last_path is None  # the step went on; nothing hashed before the write is done
    write.set_result(None)
    deadline = time.monotonic() + 30
    while not (partial / ".manifest-0.json").is_file():  # this rank's part, written in the background
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert hashed_in == ["checkpoint-manifest_0"]
    trainer.global_step = 3
    saver.on_train_batch_end(trainer, None)
    assert partial.is_dir() and saver.last_path is None  # rank 1 has not hashed its files yet: not published
    write_part(partial, 1)  # rank 1's part (its own process, in a real run)
    trainer.global_step = 4
    saver.on_train_batch_end(trainer, None)
    assert saver.last_path == tmp_path / "step-00000002" and store.damage(saver.last_path) is None
    assert (saver.last_path / MANIFEST).is_file() and not list(saver.last_path.glob(".manifest-*"))
