"""The step has one home and every strategy hook one owner.

The step's stages are plain functions in ``parallel/step.py`` (no Lightning anywhere in ``parallel/``); the strategies
call them from their hooks, and no method is defined by two of our classes in a strategy's bases (what is not the step
is a member, not a base), so no hook depends on the order of ``super()`` calls through our own classes.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from lightning_dist.strategies import (
    DataParallelStrategy,
    MeshStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dist"


@pytest.mark.parametrize(
    "strategy", [MeshStrategy, TensorParallelStrategy, PipelineParallelStrategy, DataParallelStrategy]
)
def test_no_method_is_defined_by_two_of_our_classes(strategy: type) -> None:
    ours = [cls for cls in strategy.__mro__ if cls.__module__.startswith("lightning_dist")]
    owners: dict[str, list[str]] = {}
    for cls in ours:
        for name, value in vars(cls).items():
            method = callable(value) or isinstance(value, property)
            if method and name != "__init__":  # a preset's __init__: its defaults, not a hook
                owners.setdefault(name, []).append(cls.__name__)
    twice = {name: classes for name, classes in owners.items() if len(classes) > 1}
    assert twice == {}, f"methods defined by more than one of our classes in {strategy.__name__}'s bases: {twice}"


def test_strategies_call_lightning_without_ignoring_the_mro() -> None:
    """No ``super()`` call needs ``# type: ignore[misc]`` (a mixin calling into a base it does not have)."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in (PACKAGE / "strategies").glob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "super()" in line and "type: ignore[misc]" in line
    ]
    assert found == []


def test_parallel_imports_no_lightning() -> None:
    """``parallel/`` (the axes, the layout and the step) is plain torch: the planner and any loop can call it."""
    found = []
    for path in (PACKAGE / "parallel").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [
                f"{path.name}: {name}" for name in names if name.split(".")[0] in ("lightning", "pytorch_lightning")
            ]
    assert found == []


def test_the_step_is_written_once() -> None:
    """The strategies and the planner's trace and measurement run the step through ``parallel/step.py``: none of them
    clips, reduces partial gradients or sums the experts' load itself."""
    from lightning_dist.plan import measure, trace
    from lightning_dist.strategies import data_parallel, mesh

    for module in (mesh, data_parallel, trace, measure):
        source = inspect.getsource(module)
        for own in (
            "clip_grad_norm_(",
            "reduce_partial_grads(",
            "global_grad_norm(",
            "sum_expert_load(",
            ".backward()",
        ):
            assert own not in source, f"{module.__name__} runs {own} itself instead of lightning_dist.parallel.step"
        assert "step." in source, module.__name__
