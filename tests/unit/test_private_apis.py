"""Private APIs stay in ``lightning_dist/_compat.py``; no module imports another's underscored names.

Every private torch / Lightning / transformers (and hydra, omegaconf) API the package touches is behind a named
function in ``_compat.py``, so a release that moves one changes one file. The check reads the source with ``ast``
(nothing is imported) and flags, in every other module:

- an import of a module path with a component starting with ``_`` (``torch._subclasses``; ``__future__`` is fine);
- an imported name starting with ``_`` (``from torch.distributed import _tools``, ``from lightning_dist.x import _y``);
- an attribute starting with one ``_`` (``config._attn_implementation``) on anything but ``self`` / ``cls``, and the
  same through ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a literal name.

The one exception is ``lightning_dist._compat`` itself, whose name starts with ``_`` so that nobody mistakes it for
an API of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_dist

PACKAGE = Path(lightning_dist.__file__).resolve().parent
COMPAT = "lightning_dist._compat"
#: The modules private APIs may live in: ``_compat.py`` and the parts it re-exports (``_compat_hf.py``,
#: ``_compat_pipelining.py``).
COMPAT_FILES = ("_compat.py", "_compat_hf.py", "_compat_pipelining.py")

#: ``(source of the object, attribute)`` pairs that look private but are not, each with why. Keep it short.
ALLOWED_ATTRIBUTES: dict[tuple[str, str], str] = {
    ("os", "_exit"): "a documented public function of the standard library (exit without cleanup)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _self_or_cls(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _ours(module: str | None, level: int) -> bool:
    return level > 0 or module == "lightning_dist" or (module or "").startswith("lightning_dist.")


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each use of a private name in the module ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name != COMPAT and any(_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            where = "." * node.level + module
            if module != COMPAT and any(_private(part) for part in module.split(".")):
                found.append((node.lineno, f"from {where} import {', '.join(a.name for a in node.names)}"))
            for alias in node.names:
                if not _private(alias.name):
                    continue
                if alias.name == "_compat" and (module == "lightning_dist" or (node.level and not module)):
                    continue
                whose = "another lightning_dist module's" if _ours(node.module, node.level) else "a private"
                found.append((node.lineno, f"from {where} import {alias.name} ({whose} name)"))
        elif isinstance(node, ast.Attribute):
            if _private_attribute(node.value, node.attr):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BY_NAME:
            obj, name = [*node.args, None, None][:2]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private_attribute(obj, name.value):
                found.append((node.lineno, f"{node.func.id}({ast.unparse(obj)}, {name.value!r})"))
    return sorted(found)


_BY_NAME = ("getattr", "setattr", "hasattr", "delattr")


def _private_attribute(obj: ast.expr, attr: str) -> bool:
    """Whether ``obj.<attr>`` reads a private attribute of something other than the object's own class."""
    return _private(attr) and not _self_or_cls(obj) and (ast.unparse(obj), attr) not in ALLOWED_ATTRIBUTES


def test_private_apis_only_in_compat() -> None:
    files = sorted(path for path in PACKAGE.rglob("*.py") if path.name not in COMPAT_FILES or path.parent != PACKAGE)
    assert len(files) > 20, f"found only {len(files)} modules under {PACKAGE}"
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in files
        for line, what in private_uses(path.read_text(encoding="utf-8"))
    ]
    assert not problems, (
        "private names used outside lightning_dist/_compat.py (wrap a third-party one in a _compat function; "
        "make one of ours public):\n  " + "\n  ".join(problems)
    )


def test_the_check_catches_each_kind() -> None:
    source = """
from __future__ import annotations
import os
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed import _functional_collectives
from lightning_dist import _compat
from lightning_dist.plan.memory import _block_params
from ..models import _helper
config._attn_implementation = "sdpa"
self._ok = 1
getattr(config, "_attn_implementation", None)
getattr(self, "_ok", None)
os._exit(0)
x.__dict__
"""
    lines = [line for line, _ in private_uses(source)]
    assert lines == [4, 5, 6, 8, 9, 10, 12], private_uses(source)
