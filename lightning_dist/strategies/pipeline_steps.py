"""The step hooks under pp: the module's own, run on the pipeline's view of it (see ``strategies/stages.py``).

A mixin placed after :class:`~lightning_dist.strategies.context.ContextParallelMixin` in the strategy's bases, so a
pipeline step gets this cp rank's part of the batch as a whole-model step does (and predictions come back whole).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_dist.strategies.stages import PipelineStages


class PipelineStepsMixin:
    """For a Lightning strategy with ``_pipeline``: under pp the module's step hooks run on ``_pipeline.routed``,
    whose ``compute_loss`` and model call run the schedule; without a pipeline, Lightning's own step hooks."""

    _pipeline: PipelineStages | None
    precision_plugin: Any

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        with self.precision_plugin.train_step_context():
            return self._pipeline.routed.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]
        with self.precision_plugin.val_step_context():
            return self._pipeline.routed.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)  # type: ignore[misc]
        with self.precision_plugin.test_step_context():
            return self._pipeline.routed.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)  # type: ignore[misc]
        with self.precision_plugin.predict_step_context():  # calling the model runs the pipeline (stages.py)
            return self._pipeline.routed.predict_step(*args, **kwargs)
