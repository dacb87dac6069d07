"""Every command in the README is run here, as far as this CPU machine can: the CPU quickstart runs (shortened to a
few steps), each GPU and cluster command composes and passes every check before launch (CUDA devices stated, as
lightning-hydra-template tests its configs forced onto CPU), the SLURM one prints its job, the planner plans, the
Python snippet builds its Trainers. Installs are tests/test_packaging.py's; ``make`` is CI's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_config, fresh_env

from lightning_dist import environment
from lightning_dist.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
#: Appended to a run that really trains here: a handful of steps.
SHORT = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.seq_len=32"]
#: Commands this file does not run, and who does.
ELSEWHERE = {"pip": "test_packaging.py", "uv": "test_packaging.py", "docker": "test_container.py", "make": ".ci/run",
             "curl": "replaced by a local text file (no network in tests)"}  # fmt: skip


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def commands() -> list[list[str]]:
    """Each command of the README's bash blocks, continuation lines joined, comments dropped."""
    found = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def _train_commands(kind: str) -> list[list[str]]:
    runs = [c[1:] for c in commands() if c[0] == "lightning-dist-train" and not any(a.startswith("-") for a in c)]
    on_gpu = [c for c in runs if any(a.startswith("cluster=") for a in c)]
    return on_gpu if kind == "gpu" else [c for c in runs if c not in on_gpu]


def test_the_readme_runs_only_commands_this_file_or_another_test_runs() -> None:
    known = {"lightning-dist-train", "lightning-dist-plan", *ELSEWHERE}
    assert {c[0] for c in commands()} <= known
    installs = [c for c in commands() if c[0] in ("pip", "uv")]
    assert all(any(a.startswith("lightning-dist[app] @ git+") or a == "-e" for a in c) for c in installs)
    assert "make train" in README and "make test" in README  # .ci/run and the README's promise
    assert len(README.splitlines()) <= 200


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding what the README's curl fetches (any text serves data=text; tiny Shakespeare's size, about
    1 MB, so the GPU command's batch of 64 windows fits, checked before launch) and nothing else."""
    (tmp_path / "input.txt").write_text((ROOT / "LICENSE").read_text() * 100)
    monkeypatch.chdir(tmp_path)
    return tmp_path


#: The default job runs in `make test`; the others' mechanisms have faster tests (tests/distributed): `make test-all`.
CPU_RUNS = [pytest.param(c, marks=() if c == [] else pytest.mark.slow) for c in _train_commands("cpu")]


@pytest.mark.parametrize("overrides", CPU_RUNS, ids=" ".join)
def test_the_cpu_quickstart_trains(overrides: list[str], workdir: Path) -> None:
    env = {**fresh_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [BIN / "lightning-dist-train", *overrides, *SHORT, f"hydra.run.dir={workdir / 'run'}"]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps         : 4 in" in done.stdout and (workdir / "run" / "report.html").is_file()


#: The SLURM dry run starts submitit (tests/unit/test_cluster.py prints a dry run faster): `make test-all`.
GPU_CHECKS = [
    pytest.param(c, marks=pytest.mark.slow if "cluster.slurm.dry_run=true" in c else ()) for c in _train_commands("gpu")
]


@pytest.mark.parametrize("overrides", GPU_CHECKS, ids=" ".join)
def test_each_gpu_and_cluster_command_passes_every_check_before_launch(
    overrides: list[str], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(environment, "cuda_count", lambda: 8)  # a GPU node: its devices, as torch would count them
    if "cluster.slurm.dry_run=true" in overrides:  # the login node prints the job it would submit
        done = subprocess.run([BIN / "lightning-dist-train", *overrides], cwd=workdir, env=fresh_env(),
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 0 and "#SBATCH" in done.stdout, done.stderr[-3000:]
        return
    valid = validate(compose_config(overrides, workdir / "run"))
    assert valid.dims.world_size == valid.cfg.cluster.devices * valid.cfg.cluster.num_nodes


@pytest.mark.slow  # a full search of one world size; tests/unit/test_plan.py plans smaller ones
def test_the_planner_command_plans(workdir: Path) -> None:
    (plan,) = [c for c in commands() if c[0] == "lightning-dist-plan"]
    done = subprocess.run([BIN / plan[0], *plan[1:], "plan.top=3"], cwd=workdir, env=fresh_env(), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0 and "dp_shard" in done.stdout, done.stderr[-3000:]


def test_the_python_snippet_builds_its_trainers(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "RANK"):  # a Trainer may write them
        monkeypatch.setenv(name, os.environ[name]) if name in os.environ else monkeypatch.delenv(name, False)
    (snippet,) = _blocks("python")
    exec(compile(snippet, "README.md", "exec"), {})  # constructs each Trainer: strategies resolved, nothing launched


def test_every_relative_link_in_the_readme_and_the_docs_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading)")
    assert broken == []


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_docs_page_is_in_the_index_and_opens_with_what_it_is() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name != "index.md":
            assert f"]({page.relative_to(ROOT / 'docs')})" in index, page
        assert "Moved here from" not in page.read_text(), page
    assert os.path.exists(ROOT / "docs" / "reference" / "config.md")
