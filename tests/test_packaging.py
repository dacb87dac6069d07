"""The package as a user installs it: a wheel, or a git URL with pip or uv, into an environment of their own.

Each install goes into a fresh virtual environment (no pip, no packages) whose dependencies come from this test
environment, linked in by a ``.pth`` file, and never from an index (``--no-index`` / ``--offline``): every extra
must resolve against the versions the suite runs on, and no install can fetch a CUDA build of torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = [name for name in PYPROJECT["project"]["optional-dependencies"] if name != "dev"]
UV = Path(sys.executable).parent / "uv"


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout as a git repository of one commit (what ``git+<url>`` clones)."""
    source = tmp_path_factory.mktemp("source") / "lightning-dist"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".venv*", ".git", "outputs", "multirun", "wandb", "build", "*.egg-info", "__pycache__"
        ),
    )
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    _run(*git, "init", "-q", cwd=source)
    _run(*git, "add", "-A", cwd=source)
    _run(*git, "commit", "-q", "-m", "snapshot", cwd=source)
    return source


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels]
    _run(*pip_wheel, source, cwd=wheels)
    (built,) = wheels.glob("lightning_dist-*.whl")
    return built


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This environment's packages, less lightning-dist itself (its editable install), as links in one folder."""
    folder = tmp_path_factory.mktemp("dependencies")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "lightning_dist" not in entry.name and not entry.name.startswith("__editable__"):
            (folder / entry.name).symlink_to(entry)
    return folder


def _fresh_venv(path: Path, dependencies: Path) -> Path:
    """An empty virtual environment that sees ``dependencies``; returns its python."""
    _run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    python = path / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=path).stdout.strip()
    (Path(purelib) / "_test_dependencies.pth").write_text(f"{dependencies}\n")
    return python


def _installed_from(python: Path, venv: Path) -> None:
    """``import lightning_dist`` from an unrelated folder finds the venv's copy, at pyproject's version."""
    code = "import lightning_dist as ld; print(ld.__version__); print(ld.__file__)"
    version, where = _run(python, "-c", code, cwd=venv.parent).stdout.split()
    assert version == PYPROJECT["project"]["version"]
    assert Path(where).is_relative_to(venv)


def test_the_wheel_states_its_version_license_and_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(archive.read(metadata).decode())
        (license_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in archive.read(license_file).decode()
    assert meta["Version"] == PYPROJECT["project"]["version"] == "0.5.0"
    assert meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra")) == {*EXTRAS, "dev"}
    assert "lightning_dist/conf/train.yaml" in names and "lightning_dist/conf/recipe/slurm/srun.sbatch" in names


@pytest.mark.parametrize("extra", ["", *EXTRAS])
def test_the_wheel_installs_with_each_extra_into_a_fresh_environment(
    extra: str, wheel: Path, dependencies: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, dependencies)
    requirement = f"{wheel}[{extra}]" if extra else str(wheel)
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", requirement, cwd=tmp_path)
    _installed_from(python, venv)
    if extra == "app":  # the console scripts run
        assert "lightning-dist-train" in _run(venv / "bin" / "lightning-dist-train", "--help", cwd=tmp_path).stdout


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_a_git_url_installs_into_a_fresh_environment(
    installer: str, source: Path, dependencies: Path, tmp_path: Path
) -> None:
    """README: ``pip install "lightning-dist[app] @ git+<url>"`` and ``uv pip install ...`` (uv: the package alone, as
    uv does not read ``.pth`` folders for what is installed)."""
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, dependencies)
    url = f"lightning-dist[app] @ git+file://{source}"
    if installer == "pip":
        command = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index"]
    else:
        command = [UV, "pip", "install", "--python", python, "--offline", "--no-deps", "--cache-dir", tmp_path / "uv"]
    _run(*command, "--no-build-isolation", url, cwd=tmp_path)
    _installed_from(python, venv)


def test_an_installed_wheel_finds_its_configs_from_any_directory(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
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
