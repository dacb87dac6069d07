"""``lightning-dist-export`` leaves OUT whole or untouched: written beside it and renamed into place, a folder holding
an earlier export refused unless ``--overwrite``, OUT checked before the checkpoint is read, and every error one
line. OUT is the export's own: never the run it exports, a folder above it, a checkpoint, or anything ``--overwrite``
finds without the export's marker; its files are readable by others; a failed push says what is left on disk."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoint.export import main as export_main
from lightning_dist.checkpoint.folder import EXPORT_MARKER, export_problem
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process checkpoint (Lightning's single file) of a tiny GPT, ~300 KB of weights."""
    module = GPTModule(GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2), OptimConfig(), 3)
    module.configure_model()
    path = tmp_path_factory.mktemp("ckpt") / "step-00000003"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def _refused(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        export_main(argv)
    message = str(exited.value.code)
    assert message.startswith("lightning-dist-export: ") and "\n" not in message
    return message


def test_an_earlier_export_is_never_mixed_with_a_new_one(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_main([str(checkpoint), str(out)])
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "config.json", "model.safetensors"]
    assert _refused([str(checkpoint), str(out), "--max-shard-size", "100KB"]) == (
        f"lightning-dist-export: {out} already holds files (an earlier export?); give a new folder, or pass "
        "--overwrite to replace it."
    )
    export_main([str(checkpoint), str(out), "--max-shard-size", "100KB", "--overwrite"])
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names  # the old single file would shadow the new shards in transformers
    assert names[:3] == [EXPORT_MARKER, "config.json", "model-00001-of-00006.safetensors"]
    assert "model.safetensors.index.json" in names
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left beside it
    single = tmp_path / "model.pt"
    export_main([str(checkpoint), str(single)])
    assert "already holds a file" in _refused([str(checkpoint), str(single)])
    export_main([str(checkpoint), str(single), "--overwrite"])


def test_out_is_checked_before_the_checkpoint_is_read(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"  # tests run as root, which permissions do not stop: a file in the path does
    blocker.write_text("")
    missing = tmp_path / "no-checkpoint-here"
    assert _refused([str(missing), str(blocker / "hf")]) == (
        f"lightning-dist-export: {blocker / 'hf'} cannot be written (Not a directory); give an OUT in a folder you "
        "can write."
    )
    assert "is a file, not the folder" in _refused([str(missing), str(blocker)])


WRITE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
from lightning_dist.checkpoint.export import main
for out in sys.argv[2:]:
    try:
        main([sys.argv[1], out])
    except SystemExit as exited:
        print(exited.code, file=sys.stderr)
"""


def test_a_write_that_fails_midway_is_one_line_and_leaves_nothing(checkpoint: Path, tmp_path: Path) -> None:
    """A HuggingFace folder (safetensors) and one file (torch.save), each cut off at 100 kB."""
    outs = [tmp_path / "hf", tmp_path / "model.pt"]
    done = subprocess.run(
        [sys.executable, "-c", WRITE_LIMITED, str(checkpoint), *map(str, outs)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 2, done.stderr[-3000:]
    for out, line in zip(outs, lines):
        assert line.startswith(f"lightning-dist-export: writing {out} failed (") and line.endswith(
            "); nothing was left there."
        ), line
    assert list(tmp_path.iterdir()) == []


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def runs(checkpoint: Path, tmp_path: Path) -> Path:
    """``outputs/`` holding two finished runs, each as the app leaves it: checkpoints (``latest`` naming the newest),
    Hydra's record, metrics and the report."""
    outputs = tmp_path / "outputs"
    for name in ("run-a", "run-b"):
        run = outputs / name
        (run / "checkpoints").mkdir(parents=True)
        shutil.copyfile(checkpoint, run / "checkpoints" / checkpoint.name)
        (run / "checkpoints" / "latest").write_text(checkpoint.name + "\n")
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("seed: 1234\n")
        (run / "csv").mkdir()
        (run / "csv" / "metrics.csv").write_text("step,train/loss\n0,4.1\n")
        (run / "report.json").write_text("{}")
    return outputs


def test_export_never_replaces_the_run_it_exports_nor_the_folder_above_it(runs: Path) -> None:
    """The probe: ``lightning-dist-export RUN RUN --overwrite`` (the first refusal suggested --overwrite) replaced
    the whole run folder with the export; with OUT its parent, the sibling runs went too."""
    run = runs / "run-a"
    before = _tree(runs)
    first = _refused([str(run), str(run)])
    assert first == (
        f"lightning-dist-export: {run} holds the checkpoint this export reads ({run}): writing there would replace "
        "it; give OUT outside it (a new folder)."
    )
    assert "holds the checkpoint this export reads" in _refused([str(run), str(run), "--overwrite"])
    assert "holds the checkpoint this export reads" in _refused([str(run), str(runs), "--overwrite"])
    sibling = _refused([str(run), str(runs / "run-b"), "--overwrite"])  # another run: not an export
    assert sibling == (
        f"lightning-dist-export: {runs / 'run-b'} holds a run's checkpoints, not an earlier export: --overwrite "
        f"replaces only a folder lightning-dist-export wrote (it holds {EXPORT_MARKER}); give a new folder for OUT."
    )
    inside = _refused([str(run), str(run / "checkpoints" / "hf")])
    where = run / "checkpoints"
    assert inside.endswith(
        f"inside the checkpoints folder {where}, which an export must not change; give OUT outside it (a new folder)."
    )
    ckpt_file = run / "checkpoints" / "step-00000003"
    assert "holds the checkpoint this export reads" in _refused([str(ckpt_file), str(ckpt_file), "--overwrite"])
    other_ckpt = runs / "run-b" / "checkpoints" / "step-00000003"  # a Lightning checkpoint, not a weights export
    assert "is inside the checkpoints folder" in _refused([str(ckpt_file), str(other_ckpt), "--overwrite"])
    sharded = (
        runs / "run-b" / "checkpoints" / "step-00000006"
    )  # a sharded checkpoint: DCP's .metadata, Lightning's file
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"index")
    (sharded / "meta.pt").write_bytes(b"loops")
    assert f"is inside the checkpoint {sharded}, which" in _refused([str(ckpt_file), str(sharded / "hf")])
    shutil.rmtree(sharded)
    assert _tree(runs) == before  # nothing changed, nothing left beside
    assert sorted(p.name for p in runs.iterdir()) == ["run-a", "run-b"]


def test_overwrite_replaces_only_a_folder_with_the_exports_marker(checkpoint: Path, runs: Path, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")  # a web project's file above OUT: no checkpoint
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert _refused([str(checkpoint), str(mine), "--overwrite"]) == (
        f"lightning-dist-export: {mine} holds files that are not an earlier export (no {EXPORT_MARKER}): --overwrite "
        "replaces only a folder lightning-dist-export wrote; give a new folder for OUT, or empty this one yourself."
    )
    assert (mine / "todo.txt").read_text() == "keep me"
    lightning_ckpt = tmp_path / "last.pt"  # a Lightning checkpoint named as a weights file
    shutil.copyfile(checkpoint, lightning_ckpt)
    assert "is not an earlier single-file export" in _refused([str(checkpoint), str(lightning_ckpt), "--overwrite"])
    assert lightning_ckpt.read_bytes() == checkpoint.read_bytes()
    out = tmp_path / "hf"  # an earlier export (from a run folder) is replaced, and says what it was made from
    export_main([str(runs / "run-a"), str(out)])
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["kind"] == "lightning-dist-export" and marker["source"].endswith("run-a/checkpoints/step-00000003")
    assert set(marker["files"]) == {"config.json", "model.safetensors"}
    export_main([str(runs / "run-b"), str(out), "--overwrite"])
    assert json.loads((out / EXPORT_MARKER).read_text())["source"].endswith("run-b/checkpoints/step-00000003")


def test_an_exported_folder_is_checked_against_its_marker(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_main([str(checkpoint), str(out)])
    assert export_problem(out) is None
    data = bytearray((out / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))
    assert export_problem(out) == "model.safetensors does not match the CRC-32 written with it (its bytes changed)"
    (out / "model.safetensors").write_bytes(bytes(data[:100]))
    assert export_problem(out).startswith("model.safetensors has 100 bytes, not the")
    (out / "model.safetensors").unlink()
    assert export_problem(out) == "model.safetensors is missing"


def test_exported_files_are_readable_by_others(checkpoint: Path, tmp_path: Path) -> None:
    """safetensors writes through a private temporary file (0600): a serving job of another user could not read it."""
    old = os.umask(0o022)
    try:
        export_main([str(checkpoint), str(tmp_path / "hf")])
        export_main([str(checkpoint), str(tmp_path / "model.pt")])
    finally:
        os.umask(old)
    for path in [tmp_path / "hf", *(tmp_path / "hf").iterdir(), tmp_path / "model.pt"]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


def test_a_push_without_network_says_what_is_left_on_disk(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hub to reach (a closed port: httpx's ConnectError): the export is whole on disk, and the one line says so,
    naming its files and how to upload them (not "nothing was left there")."""
    pytest.importorskip("huggingface_hub")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: connections are refused
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_write_token")
    out = tmp_path / "hf"
    message = _refused([str(checkpoint), str(out), "--push-to-hub", "me/tiny"])
    assert message.startswith("lightning-dist-export: --push-to-hub me/tiny: the hub could not be reached (")
    assert message.endswith(
        f"; the export is whole at {out} (3 files: README.md, config.json, model.safetensors): upload it with: hf "
        f"upload me/tiny {out} --exclude {EXPORT_MARKER}"
    )
    assert export_problem(out) is None and (out / "model.safetensors").is_file()
