"""``MeshStrategyView``: what telemetry, data and checkpoint code read from a strategy (``strategy_view``)."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_dist.contract import VIEW_MEMBERS, MeshStrategyView, data_parallel_kwargs, strategy_view
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies import MeshStrategy, PipelineParallelStrategy, TensorParallelStrategy


def test_the_view_lists_what_the_readers_use() -> None:
    expected = {"parallel_dims", "pipeline", "pending_save", "pop_bubble_fraction", "distributed_sampler_kwargs"}
    assert expected == VIEW_MEMBERS
    for name in VIEW_MEMBERS:
        member = getattr(MeshStrategyView, name, None)  # pending_save: an annotated attribute, documented below it
        assert name == "pending_save" or member.__doc__, name


@pytest.mark.parametrize("kind", [MeshStrategy, TensorParallelStrategy, PipelineParallelStrategy])
def test_our_strategies_are_views_before_and_after_their_layout_is_known(kind: type) -> None:
    strategy = kind()
    with pytest.raises(RuntimeError, match="before the Trainer set up processes"):
        strategy.parallel_dims  # noqa: B018 - not set up: the lookup below must not read it
    view = strategy_view(strategy)
    assert view is strategy
    assert view.pipeline is None and view.pending_save is None and view.pop_bubble_fraction() is None
    view.pending_save = "future"  # writable: the checkpoint callback takes it
    assert strategy.pending_save == "future"
    laid_out = kind(parallel_dims=ParallelDims(world_size=4, dp_shard=2, tp=2))
    assert isinstance(laid_out, MeshStrategyView)  # the Protocol itself, once reading its members works
    assert data_parallel_kwargs(laid_out) == {"num_replicas": 2, "rank": 0}


def test_lightning_strategies_are_not_views_and_keep_their_own_sampler_kwargs() -> None:
    class AtRank(DDPStrategy):
        @property
        def distributed_sampler_kwargs(self) -> dict[str, int]:
            return {"num_replicas": 4, "rank": 3}

    ddp = AtRank()
    assert strategy_view(ddp) is None and not isinstance(ddp, MeshStrategyView)
    assert data_parallel_kwargs(ddp) == {"num_replicas": 4, "rank": 3}
    assert strategy_view(None) is None and data_parallel_kwargs(None) is None
    assert data_parallel_kwargs(object()) is None
