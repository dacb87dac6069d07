"""The package as a user installs it: a wheel (not the editable checkout) run from an unrelated directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_an_installed_wheel_finds_its_configs_from_any_directory(tmp_path: Path) -> None:
    # Build from a copy, so the build leaves nothing in the checkout.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(".venv", ".git", "outputs", "multirun", "wandb", "*.egg-info", "__pycache__"),
    )
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        wheels,
        source,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("lightning_dist-*.whl")
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel, cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The wheel's copy comes first on the path, ahead of the editable checkout this environment has installed.
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    where = _run(sys.executable, "-c", "import lightning_dist; print(lightning_dist.__file__)", cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).is_relative_to(site)
    script = site / "bin" / "lightning-dist-train"
    overrides = ["trainer.max_steps=2", "logger=none", "cluster.devices=1", "trainer.limit_val_batches=0"]
    result = _run(sys.executable, script, *overrides, "trainer.num_sanity_val_steps=0", cwd=elsewhere, env=env)
    assert "steps         : 2 in" in result.stdout
