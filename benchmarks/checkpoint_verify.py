"""What a checkpoint's manifest costs: hashing a multi-GB checkpoint when it is published, and checking it before a
run continues from it or exports it (the page cache warm, as right after a save, and cold, as after a reboot).

Run by hand: ``.venv/bin/python benchmarks/checkpoint_verify.py [--dir /tmp/verify-bench] [--gib 2]``.

- The checkpoint: a real DCP folder of ``--gib`` GiB (random fp32 tensors of 64 MiB, written by
  :func:`lightning_dist.checkpoint.store.save` in one process, DCP fsyncing each file) and Lightning's ``meta.pt``.
- Hash at publish: this rank's part of the manifest (:func:`~lightning_dist.checkpoint.folder.write_part`) and the
  merge (:func:`~lightning_dist.checkpoint.folder.merge_parts`), right after the write (files in the page cache).
- Verify: :func:`~lightning_dist.checkpoint.store.damage` with ``checksums=True`` (the default) and ``False``
  (``checkpoint.verify=sizes``); warm, then cold: each file's pages dropped with ``posix_fadvise(DONTNEED)`` (clean
  pages after DCP's fsync), so the check reads the disk.
- The checksums compared on the same file, warm (why CRC-32): ``zlib.crc32``, ``zlib.adler32``, ``hashlib``'s sha256,
  sha1 and blake2b, and a read alone.

Results: docs/failures.md, "Damaged checkpoints".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
import warnings
import zlib
from pathlib import Path

import torch

from lightning_dist.checkpoint import store
from lightning_dist.checkpoint.folder import merge_parts, write_part


def drop_cache(folder: Path) -> None:
    """Evict ``folder``'s files from the page cache (their pages are clean: DCP fsynced them)."""
    for path in folder.iterdir():
        with path.open("rb") as file:
            os.fsync(file.fileno())
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def checksum_speeds(path: Path) -> dict[str, float]:
    """MB/s of each checksum over ``path`` (warm), 8 MiB at a time."""
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)

    def stream(update) -> float:
        with open(path, "rb", buffering=0) as file:
            seconds = timed(lambda: [update(view[:n]) for n in iter(lambda: file.readinto(buffer), 0)])
        return path.stat().st_size / seconds / 1e6

    state = {"crc": 0, "adler": 1}
    speeds = {"read alone": stream(lambda chunk: None)}
    speeds["zlib.crc32"] = stream(lambda chunk: state.__setitem__("crc", zlib.crc32(chunk, state["crc"])))
    speeds["zlib.adler32"] = stream(lambda chunk: state.__setitem__("adler", zlib.adler32(chunk, state["adler"])))
    for name in ("sha256", "sha1", "blake2b"):
        digest = hashlib.new(name)
        speeds[f"hashlib.{name}"] = stream(digest.update)
    return speeds


def write_checkpoint(folder: Path, count: int) -> float:
    """Seconds to write a DCP checkpoint of ``count`` random fp32 tensors of 64 MiB to ``folder``."""
    state = {"state_dict": {f"layer{i}.weight": torch.randn(4096, 4096) for i in range(count)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process
        return timed(lambda: store.save(state, {"global_step": 1}, folder, global_rank=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/verify-bench"))
    parser.add_argument("--gib", type=float, default=2.0)
    args = parser.parse_args()
    folder = args.dir / "step-00000001"
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    saved = write_checkpoint(folder, round(args.gib * 16))
    size = sum(path.stat().st_size for path in folder.iterdir())
    gb = size / 1e9
    hashed = timed(lambda: (write_part(folder, 0), merge_parts(folder)))
    print(f"checkpoint: {size / 2**30:.2f} GiB ({gb:.2f} GB) in {len(list(folder.iterdir()))} files, {sys.platform}")
    print(f"save (dcp.save, fsynced): {saved:.2f} s; manifest at publish (hash, warm): {hashed:.2f} s "
          f"({gb / hashed:.2f} GB/s, +{100 * hashed / saved:.0f}% of the save)")  # fmt: skip
    for cache in ("warm", "cold"):
        for checksums in (True, False):
            if cache == "cold":
                drop_cache(folder)
            os.utime(folder / "meta.pt")  # a new modification time: damage() checks again, not from memory
            seconds = timed(lambda: store.damage(folder, checksums=checksums))  # noqa: B023
            kind = "sizes + CRC-32" if checksums else "sizes only   "
            print(f"verify {kind} ({cache}): {seconds:.3f} s = {seconds / gb:.3f} s per GB")
    shard = max(folder.iterdir(), key=lambda path: path.stat().st_size)
    checksum_speeds(shard)  # once to bring it into the page cache
    for name, speed in checksum_speeds(shard).items():
        print(f"{name:16s} {speed:7.0f} MB/s (warm, {shard.stat().st_size / 1e9:.2f} GB)")
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
