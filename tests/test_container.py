"""The Dockerfile and the sbatch recipes that run it: the image installs the package's extras on its own CUDA torch,
and each sbatch script starts the same command in a venv, under pyxis (srun --container-image) or under apptainer."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "lightning_dist" / "conf" / "recipe" / "slurm"


def test_the_dockerfile_installs_every_user_extra_on_the_images_own_torch() -> None:
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE).group(1)
    assert re.fullmatch(r"pytorch/pytorch:2\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base)
    extras = re.search(r"^ARG EXTRAS=(\S+)$", text, re.MULTILINE).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras) == sorted(name for name in declared if name != "dev")
    assert 'pip install -c /tmp/torch-constraint.txt ".[${EXTRAS}]"' in text  # torch pinned to the image's build
    assert 'ENTRYPOINT ["lightning-dist-train"]' in text
    for path in re.findall(r"^COPY (.+) \./", text, re.MULTILINE):
        assert all((ROOT / part).exists() for part in path.split()), path


def _submit(script: Path, tmp_path: Path, **env: str) -> list[str]:
    """Run an sbatch script as SLURM would on the first node, with stand-ins for srun and scontrol that print."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node01\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    job = tmp_path / "job"
    (job / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (job / ".venv" / "bin" / "activate").write_text('echo "venv activated"\n')
    variables = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
                 "SLURM_JOB_NODELIST": "node[01-02]", **env}  # fmt: skip
    done = subprocess.run(["bash", str(script), "recipe=tiny_ddp_cpu"], cwd=job, env=variables, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("script", ["srun.sbatch", "torchrun.sbatch"])
def test_the_sbatch_recipes_run_in_a_venv_or_in_the_container(script: str, tmp_path: Path) -> None:
    job = tmp_path / "job"
    venv = _submit(SBATCH / script, tmp_path)
    assert venv[0] == "venv activated" and venv[1].startswith("srun --kill-on-bad-exit=1 ")
    assert venv[1].endswith("cluster=node_8gpu cluster.num_nodes=2 recipe=tiny_ddp_cpu")
    command = venv[1].removeprefix("srun --kill-on-bad-exit=1 ")

    (pyxis,) = _submit(SBATCH / script, tmp_path, CONTAINER_IMAGE="registry/lightning-dist:0.5.0")
    mounts = f"--container-image=registry/lightning-dist:0.5.0 --container-mounts={job}:{job} --container-workdir={job}"
    assert pyxis == f"srun --kill-on-bad-exit=1 {mounts} {command}"

    (apptainer,) = _submit(SBATCH / script, tmp_path, APPTAINER_IMAGE="/images/lightning-dist.sif")
    exec_ = f"apptainer exec --nv --bind {job} --pwd {job} /images/lightning-dist.sif"
    assert apptainer == f"srun --kill-on-bad-exit=1 {exec_} {command}"
