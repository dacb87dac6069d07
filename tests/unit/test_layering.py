"""The package reads as a map: imports only go down the layers, there are no import circles, and a function-local
import is kept for an optional dependency, or for a heavy module the launcher's process must not load (each says so
in a comment).

Layers, lowest first (docs/concepts/design.md): what a module may import is its own layer and the ones below.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dist"

#: Top-level name (module or folder of lightning_dist) -> layer.
LAYERS: dict[str, int] = {
    "_compat": 0,
    "_compat_hf": 0,
    "_compat_pipelining": 0,
    "lazy": 0,
    "errors": 0,
    "parallel_dims": 0,
    "environment": 0,  # where this process runs: launcher, restarts, run folder
    "hub": 0,  # the HuggingFace hub: snapshots and streams, offline-aware
    "manifest": 0,  # files' sizes and CRC-32s: what the project writes and checks before reading it back
    "parallel": 1,  # model-agnostic parallelism: no Lightning, no model code
    "contract": 2,  # what a LightningModule may offer the strategies
    "models": 2,
    "data": 2,
    "checkpoint": 3,
    "strategies": 4,  # Lightning glue
    "callbacks": 5,
    "telemetry": 5,
    "config": 6,  # the run's schema, the objects it builds, the one validation pass
    "plan": 7,
    "run": 8,  # entry points and the run's lifecycle
}
#: Optional dependencies a function may import locally (each such import says why in a comment on its line or above).
OPTIONAL = ("transformers", "huggingface_hub", "submitit", "matplotlib", "rich", "safetensors", "tokenizers",
            "datasets", "wandb", "peft", "lm_eval", "torchao", "torchft")  # fmt: skip
#: Heavy modules (torch, Lightning, and ours that import them) that a module on the launcher's path imports inside the
#: one function that needs them: ``lightning-dist-train`` checks a config and starts the ranks without them (its ranks
#: fork from a server that has them loaded), and only the configs, restarts or ranks that use them pay for them.
#: importer -> what it may import so; each such import says why in a comment. Down the layers as any import.
DEFERRED: dict[str, tuple[str, ...]] = {
    "lightning_dist.environment": ("torch",),  # CUDA devices, for cluster.accelerator=gpu / auto
    "lightning_dist.config.pretrained": ("lightning_dist.checkpoint.weights",),  # model.pretrained only
    "lightning_dist.config.shapes": (
        "lightning_dist.models.hf",  # model=hf only
        "lightning_dist.models.hf_init",  # model=hf only: its class's attention implementations
    ),
    "lightning_dist.config.validate": (
        "lightning_dist.config.start",  # a checkpoint or weights to start from
        "lightning_dist.data.datamodule",  # data=text / tokens / hf: their files are read before launch
        "lightning_dist.models.gpt_parallel",  # tp > 1
        "lightning_dist.models.hf_context",  # model=hf with cp > 1
    ),
    "lightning_dist.parallel_dims": ("torch.distributed.device_mesh",),  # a rank builds the mesh
    "lightning_dist.run.cluster": ("lightning.pytorch", "lightning.pytorch.plugins.environments"),  # in a rank
    "lightning_dist.run.entry": (  # each console script, once the app's packages are known to be installed
        "lightning_dist.plan.cli",
        "lightning_dist.run.help",
        "lightning_dist.run.reproduce",
        "lightning_dist.run.train",
        "lightning_dist.telemetry.report",
    ),
    "lightning_dist.run.evaluate": (  # once the arguments are read: `--help` answers without torch
        "lightning_dist.callbacks.evaluation",
        "lightning_dist.checkpoint.hf_model",
    ),
    "lightning_dist.run.generate": ("torch", "lightning_dist.checkpoint.hf_model"),  # as run.evaluate
    "lightning_dist.run.launch": ("torch", "torch.distributed"),  # in a rank
    "lightning_dist.run.train": (
        "lightning_dist.checkpoint.resume",  # a restart
        "lightning_dist.plan.estimate_run",  # in rank 0
        "lightning_dist.run.fit",  # in a rank
    ),
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
        if "conf" not in path.parts
    }


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported lightning_dist module, line, inside a function) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    modules = _modules()
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: never executed
            if isinstance(child, ast.ImportFrom) and child.module:
                base = child.module if child.level == 0 else _relative(module, path, child)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append((full if full in modules else base, child.lineno, inner))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, inner) for alias in child.names)
            visit(child, inner)

    visit(tree, False)
    return [(name, line, local) for name, line, local in found if name.startswith("lightning_dist")] + [
        (name, line, local) for name, line, local in found if local and not name.startswith("lightning_dist")
    ]


def _relative(module: str, path: Path, node: ast.ImportFrom) -> str:
    parts = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")[: 1 - node.level]
    return ".".join([*parts, node.module])


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = {
            name for name, _, local in _imports(path, module) if name in modules and name != module and not local
        }
    return graph


def test_every_top_level_module_has_a_layer() -> None:
    tops = {module.split(".")[1] for module in _modules() if module.count(".") >= 1}
    assert tops - set(LAYERS) == set(), (
        "give each new top-level module or folder a layer in LAYERS (and docs/concepts/design.md)"
    )


def test_imports_only_go_down() -> None:
    up = []
    for module, path in _modules().items():
        own = _layer(module)
        for name, line, _ in _imports(path, module):
            target = _layer(name) if name.startswith("lightning_dist.") else None
            if own is not None and target is not None and target > own:
                up.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} (layer {target} > {own})")
    assert up == [], "imports from a lower layer up to a higher one:\n" + "\n".join(up)


def test_no_import_circles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert cycles == [], "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_function_local_imports_are_for_optional_dependencies_only() -> None:
    local: dict[str, None] = {}
    for module, path in _modules().items():
        if module in ("lightning_dist._compat", "lightning_dist._compat_hf", "lightning_dist._compat_pipelining"):
            continue  # each private API is imported where it is used: a release that moves one breaks only its user
        lines = path.read_text().splitlines()
        for name, line, inner in _imports(path, module):
            if not inner or name.split(".")[0] in OPTIONAL or name in DEFERRED.get(module, ()):
                continue
            local[f"{path.relative_to(PACKAGE.parent)}:{line} {lines[line - 1].strip()}"] = None
    assert not local, f"{len(local)} function-local imports of required modules:\n" + "\n".join(local)


#: The longest a function may be: a longer one is a sequence of steps that want names (split it there).
MAX_FUNCTION_LINES = 80


def test_functions_read_as_named_steps() -> None:
    """A file is split by concern, never by a line count; a function over ``MAX_FUNCTION_LINES`` is split into named
    steps."""
    long: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.add(f"{path.relative_to(PACKAGE.parent)}:{node.name}")
    assert long == set(), f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps"


def test_the_formatter_owns_the_layout() -> None:
    """``# fmt: skip`` keeps an aligned table only; code is laid out by ``ruff format``."""
    skips = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]
    assert skips == [], "let ruff format lay these out: " + ", ".join(skips)
