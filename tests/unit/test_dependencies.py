"""The strategies, callbacks, telemetry, models and data need only torch, Lightning and the core dependencies.

The app (``lightning-dist-train``: Hydra configs, W&B, the run report's plots, rich output) has its own extra,
``lightning-dist[app]``. Read from the source with ``ast`` (nothing imported): every module a library user's import
reaches (module-level imports, followed through the package) imports none of the app's packages at module level; a
function may import one where it is needed (an optional dependency, ``test_layering.OPTIONAL``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_dist"
APP = {"hydra", "omegaconf", "wandb", "matplotlib", "rich", "submitit"}
#: What ``import lightning_dist`` and its documented exports reach, for someone writing their own Trainer script.
LIBRARY = (
    "lightning_dist",
    "lightning_dist.strategies",
    "lightning_dist.callbacks.checkpoints",
    "lightning_dist.callbacks.heartbeat",
    "lightning_dist.callbacks.preemption",
    "lightning_dist.callbacks.progress",
    "lightning_dist.telemetry",
    "lightning_dist.parallel.pipeline",
    "lightning_dist.models.module",
    "lightning_dist.models.hf",
    "lightning_dist.data.datamodule",
    "lightning_dist.checkpoint.export",
)


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _module_level_imports(module: str, path: Path) -> set[str]:
    """Absolute names this module imports when it is executed (not inside functions or ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, base]) if base else ".".join(parts)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names if _path(f"{base}.{alias.name}"))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _lazy_targets(path: Path) -> set[str]:
    """Modules named in a package's lazy export table (``"Name": "lightning_dist.x"``), imported on first use."""
    return set(re.findall(r'"(lightning_dist(?:\.\w+)+)"', path.read_text())) if path.name == "__init__.py" else set()


def test_what_a_library_user_imports_needs_none_of_the_apps_packages() -> None:
    seen: dict[str, str] = {}  # module -> the module that imported it
    todo = [(module, "(root)") for module in LIBRARY]
    offenders: list[str] = []
    while todo:
        module, parent = todo.pop()
        if module in seen:
            continue
        seen[module] = parent
        path = _path(module)
        if path is None:
            continue
        for name in sorted(_module_level_imports(module, path) | _lazy_targets(path)):
            top = name.split(".")[0]
            if top == "lightning_dist":
                todo.append((name, module))
            elif top in APP:
                offenders.append(f"{module} imports {name} (reached from {parent})")
    assert "lightning_dist.strategies.mesh" in seen
    assert not offenders, "\n".join(offenders)


def test_the_app_packages_are_an_extra_and_the_dev_install_has_them() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!\[ ;]", requirement)[0].lower() for requirement in requirements}

    core, extras = names(project["dependencies"]), project["optional-dependencies"]
    assert not core & {"hydra-core", "omegaconf", "wandb", "matplotlib", "rich"}, core
    assert {"torch", "lightning", "torchmetrics"} <= core
    assert {"hydra-core", "omegaconf", "wandb", "matplotlib", "rich"} <= names(extras["app"])
    assert names(extras["app"]) <= names(extras["dev"])


def test_a_console_script_without_the_app_extra_names_the_install(monkeypatch) -> None:
    import importlib.util

    import pytest

    from lightning_dist.run import entry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(SystemExit, match=r"^lightning-dist-train needs wandb .* pip install 'lightning-dist\[app\]'$"):
        entry.train()
