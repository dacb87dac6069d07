"""``lightning-dist-export`` leaves OUT whole or untouched: written beside it and renamed into place, a folder holding
an earlier export refused unless ``--overwrite``, OUT checked before the checkpoint is read, and every error one
line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoint.export import main as export_main
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
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert _refused([str(checkpoint), str(out), "--max-shard-size", "100KB"]) == (
        f"lightning-dist-export: {out} already holds files (an earlier export?); give a new folder, or pass "
        "--overwrite to replace it."
    )
    export_main([str(checkpoint), str(out), "--max-shard-size", "100KB", "--overwrite"])
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names  # the old single file would shadow the new shards in transformers
    assert names[:2] == ["config.json", "model-00001-of-00006.safetensors"] and "model.safetensors.index.json" in names
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
