"""The launcher of ``lightning-dist-train`` checks a config and starts the ranks without importing what the ranks run.

torch, Lightning and what Lightning pulls in take seconds to import (and a second more to unload at exit); the ranks
fork from a server that has them loaded (``lightning_dist.run.launch``), so the launching process must not import
them itself. Each check runs in a fresh interpreter and reads ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: What the launcher must not import (each a second or more on a small machine).
HEAVY = ("torch", "lightning", "transformers", "torchmetrics")


def _heavy_after(code: str) -> list[str]:
    """The modules of ``HEAVY`` that running ``code`` in a fresh interpreter imported."""
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "lightning_dist",  # the package root: its names (MeshStrategy, ...) load on first use
        "lightning_dist.callbacks.beat_file",  # the callbacks (Lightning) load on first use
        "lightning_dist.environment",  # CUDA devices are counted only for cluster.accelerator=gpu / auto
        "lightning_dist.data.config",
        "lightning_dist.models.gpt_config",  # GPT (torch) loads on first use
        "lightning_dist.models.optim_config",
        "lightning_dist.parallel.options",  # the schedules and checkpointing modes, without their torch code
        "lightning_dist.parallel_dims",  # the mesh is built in a rank
        "lightning_dist.run.cluster",  # Lightning's environments are built in a rank
        "lightning_dist.telemetry.report",  # the telemetry callbacks load on first use
    ],
)
def test_launcher_modules_import_nothing_heavy(module: str) -> None:
    assert _heavy_after(f"import {module}") == []


@pytest.mark.parametrize("script", ["lightning_dist.run.evaluate", "lightning_dist.run.generate"])
def test_the_help_of_eval_and_generate_answers_without_torch(script: str) -> None:
    """``lightning-dist-eval --help`` took 8-9 s: its imports (torch, Lightning, lm-eval) came before argparse."""
    code = f"from {script} import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert _heavy_after(code) == []


def test_importing_the_package_still_registers_our_strategies_with_lightning() -> None:
    """README: ``import lightning_dist`` registers "mesh", "fsdp2", "tensor_parallel" and "pipeline_parallel",
    whichever of the two packages is imported first; a ``Trainer`` given the name builds our strategy."""
    for first, second in (("lightning_dist", "lightning.pytorch"), ("lightning.pytorch", "lightning_dist")):
        check = """
from lightning.pytorch import Trainer
from lightning_dist import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy
expected = {"mesh": MeshStrategy, "fsdp2": MeshStrategy, "tensor_parallel": TensorParallelStrategy,
            "pipeline_parallel": PipelineParallelStrategy}
for name, cls in expected.items():
    strategy = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy
    assert type(strategy) is cls, (name, type(strategy))
assert Trainer(strategy="fsdp2", accelerator="cpu", devices=1, logger=False).strategy.parallelism.dp_shard == -1
"""
        _heavy_after(f"import {first}, {second}\n{check}")


def test_the_package_reports_its_installed_version() -> None:
    from importlib.metadata import version

    import lightning_dist

    assert lightning_dist.__version__ == version("lightning-dist") != "0.1.0"


def test_the_launcher_checks_the_default_config_without_torch_or_lightning(tmp_path: Path) -> None:
    code = f"""
from hydra import compose, initialize_config_dir
import lightning_dist.run.train
from lightning_dist.config.schema import CONF_DIR, to_train_config
from lightning_dist.config.validate import validate
with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    cfg = compose("train", overrides=["output_dir={tmp_path}"])
validate(to_train_config(cfg))
"""
    assert _heavy_after(code) == []
