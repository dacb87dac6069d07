"""lightning-dist: tensor, pipeline and data parallelism for the PyTorch Lightning Trainer.

The names below are imported on first use (PEP 562), so a process that only checks a config and starts ranks (the
``lightning-dist-train`` launcher) never imports torch or Lightning. ``import lightning_dist`` still registers
``"mesh"``, ``"fsdp2"``, ``"tensor_parallel"`` and ``"pipeline_parallel"`` in Lightning's ``StrategyRegistry``: at
once when Lightning is loaded, else the moment it is (no ``Trainer`` can look a name up before that). Lightning's own
``"fsdp"`` is FSDP1; ``"fsdp2"`` and ``"mesh"`` are FSDP2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_dist.lazy import lazy_exports


def _package_version() -> str:
    """The installed distribution's version (pyproject.toml's, one source of truth); a source tree that was never
    installed reports ``0+unknown``."""
    try:
        return version("lightning-dist")
    except PackageNotFoundError:
        return "0+unknown"


if TYPE_CHECKING:
    from lightning_dist.contract import ParallelModule
    from lightning_dist.parallel.pipeline import PipelineSpec
    from lightning_dist.parallel_dims import ParallelDims
    from lightning_dist.strategies import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy
    from lightning_dist.telemetry import Telemetry

#: Public name -> the module that defines it.
_EXPORTS = {
    "MeshStrategy": "lightning_dist.strategies",
    "ParallelDims": "lightning_dist.parallel_dims",
    "ParallelModule": "lightning_dist.contract",
    "PipelineParallelStrategy": "lightning_dist.strategies",
    "PipelineSpec": "lightning_dist.parallel.pipeline",
    "Telemetry": "lightning_dist.telemetry",
    "TensorParallelStrategy": "lightning_dist.strategies",
}
#: Importing it registers our strategies in Lightning's StrategyRegistry.
_REGISTERS = "lightning_dist.strategies"

__all__ = [
    "MeshStrategy",
    "ParallelDims",
    "ParallelModule",
    "PipelineParallelStrategy",
    "PipelineSpec",
    "Telemetry",
    "TensorParallelStrategy",
]
__version__ = _package_version()


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` once module ``name`` has been executed, the first time it is imported (then steps aside)."""

    def __init__(self, name: str, then: Callable[[], object]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the finders after this one, as if it had not been there
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


if "lightning.pytorch" in sys.modules:
    importlib.import_module(_REGISTERS)
elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport("lightning.pytorch", lambda: importlib.import_module(_REGISTERS)))
