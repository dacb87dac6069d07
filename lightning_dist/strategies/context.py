"""The batch across the cp axis: each cp rank steps on its part of every sequence; predictions come back whole.

The rule for any batch (:func:`lightning_dist.parallel.context.shard_batch`): every tensor whose dim 1 is the sequence
length (dim 1 of the batch's first tensor of two or more dims) is cut into ``2 x cp`` chunks and cp rank ``r`` keeps
chunks ``r`` and ``2 cp - 1 - r``; other values arrive whole. The built-in ``(inputs, targets)`` batches are (B, T).

The module's cp changes (attention functions, position hooks) last as long as the strategy's loops: teardown undoes
them, so the same LightningModule used afterwards without cp (in one process, under another strategy) computes as
before, and the start of this strategy's next loop (``trainer.validate`` after ``fit``) makes them again.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_dist.parallel.context import (
    UndoneChanges,
    gather_outputs,
    sequence_length,
    shard_batch,
    undo_context_parallel,
)
from lightning_dist.parallel_dims import ParallelDims


class ContextParallelMixin:
    """For a Lightning strategy with ``parallel_dims``: the step hooks receive this cp rank's part of the batch."""

    parallel_dims: ParallelDims
    lightning_module: Any
    _cp_undone: UndoneChanges | None = None  # what this strategy's teardown undid, made again at its next loop

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            # Under pp the changes were made to the stages' views (position hooks, torch's ring dispatcher) too.
            roots = [self.lightning_module, *getattr(getattr(self, "_pipeline", None), "views", ())]
            records = [record for root in roots for record in undo_context_parallel(root).records]
            undone = UndoneChanges(sorted(records, key=lambda record: record[1].order))  # redone oldest first
            if len(undone) or self._cp_undone is None:  # a second teardown before the next loop keeps the first's
                self._cp_undone = undone
        super().teardown()  # type: ignore[misc]

    def _redo_context_parallel(self) -> None:
        if self._cp_undone is not None:  # this strategy's own changes only (not another strategy's, undone earlier)
            self._cp_undone.redo()
            self._cp_undone = None

    @override
    def on_train_start(self) -> None:
        self._redo_context_parallel()
        super().on_train_start()  # type: ignore[misc]

    @override
    def on_validation_start(self) -> None:
        self._redo_context_parallel()
        super().on_validation_start()  # type: ignore[misc]

    @override
    def on_test_start(self) -> None:
        self._redo_context_parallel()
        super().on_test_start()  # type: ignore[misc]

    @override
    def on_predict_start(self) -> None:
        self._redo_context_parallel()
        super().on_predict_start()  # type: ignore[misc]

    def shard_step_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The step's arguments with its batch (the first positional argument, or ``batch=``) cut for this cp rank."""
        dims = self.parallel_dims
        if not dims.cp_enabled:
            return args, kwargs
        rank = dims.mesh["cp"].get_local_rank()
        if args:
            return (shard_batch(args[0], dims.cp, rank), *args[1:]), kwargs
        if "batch" in kwargs:
            return args, {**kwargs, "batch": shard_batch(kwargs["batch"], dims.cp, rank)}
        return args, kwargs

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.shard_step_args(args, kwargs)
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.shard_step_args(args, kwargs)
        return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.shard_step_args(args, kwargs)
        return super().test_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module predicts on this rank's part; outputs whose dim 1 is the local length are gathered whole."""
        dims = self.parallel_dims
        if not dims.cp_enabled:
            return super().predict_step(*args, **kwargs)  # type: ignore[misc]
        batch = args[0] if args else kwargs.get("batch")
        args, kwargs = self.shard_step_args(args, kwargs)
        outputs = super().predict_step(*args, **kwargs)  # type: ignore[misc]
        seq_len = sequence_length(batch)
        if seq_len is None:
            return outputs
        return gather_outputs(outputs, seq_len // dims.cp, dims.mesh["cp"].get_group())
