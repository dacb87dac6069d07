"""``lightning-dist-train --help``: the app's own name, real groups only, each group's options and fields, a field's
help from its docstring; docs/reference/config.md is the same text and must be current."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dist import __version__
from lightning_dist.parallel.options import Parallelism
from lightning_dist.run.help import SCHEMAS, fields_of, groups, help_text, markdown, options, sections, top_fields

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = shutil.which("lightning-dist-train", path=str(Path(sys.executable).parent)) or "lightning-dist-train"


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_help_names_the_app_and_offers_real_groups_with_their_options() -> None:
    done = _help("--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith(f"lightning-dist-train {__version__}: ") and "powered by Hydra" not in text
    assert "_schema" not in text  # the ConfigStore's schemas are not options
    for group in ("model", "data", "parallelism", "cluster", "trainer", "logger", "callbacks", "debug", "recipe"):
        assert group in groups()
        line = next(line for line in text.splitlines() if line.startswith(f"  {group} "))
        assert options(group)[0][0] in line
    assert "gpt_tiny*" in text and "wandb*" in text  # the defaults, starred
    for section in ("optim", "checkpoint", "telemetry", "resilience"):
        assert f"  {section} " in text


def test_help_of_a_group_lists_its_options_and_every_field_with_its_docstring() -> None:
    text, found = help_text("parallelism", ["parallelism=tp_fsdp"])
    assert found
    assert "  fsdp  " in text and "FSDP1" in text  # the option's comment says which FSDP
    assert "  tp_fsdp*" in text  # the override's choice
    for field in dataclasses.fields(Parallelism):  # a section's fields, each under its section's name
        names = (
            [f"{field.name}.{leaf.name}" for leaf in dataclasses.fields(field.default_factory)]
            if (dataclasses.is_dataclass(field.default_factory))
            else [field.name]
        )
        for name in names:
            assert f"  parallelism.{name}: " in text, name
    assert "  parallelism.tp: int = 2\n      Tensor-parallel degree." in text  # the value the overrides give
    assert "  parallelism.diloco.every: int = 50\n      H: inner optimizer steps per outer step" in text
    assert "Lightning loggers by name" in help_text("logger", [])[0]


def test_help_of_a_field_and_of_a_mistyped_one() -> None:
    done = _help("parallelism=tp_fsdp", "--help", "parallelism.tp")
    assert done.returncode == 0 and done.stdout.splitlines()[:2] == [
        "parallelism.tp: int = 2",
        "Tensor-parallel degree.",
    ]
    assert help_text("optim.lr", [])[0].startswith("optim.lr: float = 0.003\nPeak learning rate.")
    assert help_text("seed", [])[0].startswith("seed: int = 1234")
    wrong = _help("--help", "paralelism.tpp")
    assert wrong.returncode == 2 and "did you mean parallelism.tp" in wrong.stderr


@pytest.mark.parametrize("cls", [*SCHEMAS.values(), *sections().values()], ids=lambda cls: cls.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    undocumented = [name for name, _, doc in fields_of(cls) if not doc]
    assert undocumented == [], f"{cls.__name__}: give these fields a docstring (their --help text): {undocumented}"
    assert all(doc for _, _, doc in top_fields())


def test_the_config_reference_is_current() -> None:
    committed = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert committed == markdown(), (
        "docs/reference/config.md is stale: python -m lightning_dist.run.help --markdown > docs/reference/config.md"
    )
