"""The module's context-parallel changes across a strategy's loops: undone at teardown, made again at the next loop.

The changes (attention functions, position hooks: :func:`lightning_dist.parallel.context.apply_context_parallel`)
last as long as the strategy's loops: teardown undoes them, so the same LightningModule used afterwards without cp (in
one process, under another strategy) computes as before, and the start of this strategy's next loop
(``trainer.validate`` after ``fit``) makes them again. The batch itself is cut per cp rank by the step
(:func:`lightning_dist.parallel.step.local_step_args`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_dist.parallel.context import UndoneChanges, undo_context_parallel


class ContextParallelChanges:
    """What a strategy's teardown undid of its cp changes, to make again at its next loop (a member of
    :class:`~lightning_dist.strategies.mesh.MeshStrategy`)."""

    def __init__(self) -> None:
        self._undone: UndoneChanges | None = None

    def undo(self, roots: Iterable[nn.Module]) -> None:
        """Undo the changes made to ``roots`` (the module, and under pp the stages' views: position hooks, torch's
        ring dispatcher), keeping them to redo, oldest first."""
        records = [record for root in roots for record in undo_context_parallel(root).records]
        undone = UndoneChanges(sorted(records, key=lambda record: record[1].order))
        if len(undone) or self._undone is None:  # a second teardown before the next loop keeps the first's
            self._undone = undone

    def redo(self) -> None:
        """Make this strategy's own changes again (not another strategy's, undone earlier)."""
        if self._undone is not None:
            self._undone.redo()
            self._undone = None
