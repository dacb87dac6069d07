"""ParallelDims: degree arithmetic, validation messages, coordinates. No process group needed."""

from __future__ import annotations

import itertools

import pytest

from lightning_dist.parallel_dims import AXES, ParallelDims


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_every_factorization_is_accepted_and_covers_every_rank_once(world_size: int) -> None:
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for dp_replicate, tp, pp in itertools.product(divisors, repeat=3):
        if world_size % (dp_replicate * tp * pp):
            continue
        dims = ParallelDims(world_size, dp_replicate=dp_replicate, dp_shard=-1, tp=tp, pp=pp)
        assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == world_size
        coords = {tuple(dims.coordinates(rank).values()) for rank in range(world_size)}
        assert len(coords) == world_size  # a bijection between ranks and mesh coordinates


def test_minus_one_takes_the_rest() -> None:
    assert ParallelDims(8, dp_shard=-1, tp=2).dp_shard == 4
    assert ParallelDims(8, dp_replicate=-1, dp_shard=1, tp=2, pp=2).dp_replicate == 2
    assert ParallelDims(4, dp_shard=-1, tp=4).dp_shard == 1


def test_tp_is_innermost_and_pp_outermost() -> None:
    dims = ParallelDims(8, dp_shard=2, tp=2, pp=2)
    assert dims.coordinates(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert dims.coordinates(2) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert dims.coordinates(4)["pp"] == 1
    assert list(dims.degrees) == list(AXES)


def test_data_parallel_rank_is_shared_by_tp_and_pp_peers() -> None:
    dims = ParallelDims(8, dp_replicate=2, dp_shard=1, tp=2, pp=2)
    by_dp: dict[int, list[int]] = {}
    for rank in range(8):
        by_dp.setdefault(dims.dp_rank(rank), []).append(rank)
    assert sorted(by_dp) == [0, 1]
    assert all(len(ranks) == 4 for ranks in by_dp.values())  # tp x pp ranks read each batch
    assert dims.dp_size == 2 and dims.model_parallel_size == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "tp": 3}, r"tp=3 = 3, but world_size=4|multiply to 3"),
        ({"world_size": 4, "dp_shard": 2, "tp": 4}, r"dp_shard=2 x tp=4 x pp=1 = 8, but world_size=4"),
        ({"world_size": 4, "dp_replicate": -1, "dp_shard": -1}, r"only one data-parallel degree"),
        ({"world_size": 4, "tp": 0}, r"tp=0 must be >= 1"),
        ({"world_size": 4, "pp": -2}, r"pp=-2 must be >= 1"),
        ({"world_size": 4, "dp_shard": 0}, r"dp_shard=0 must be >= 1, or -1"),
        ({"world_size": 4, "cp": 0}, r"cp=0 must be >= 1"),
        ({"world_size": 4, "cp": 2, "tp": 4}, r"dp_shard=1 x cp=2 x tp=4 x pp=1 = 8, but world_size=4|multiply to 8"),
        ({"world_size": 0}, r"world_size=0 must be >= 1"),
    ],
)
def test_bad_layouts_name_the_value_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_describe_and_flags() -> None:
    dims = ParallelDims(4, dp_shard=2, tp=2)
    assert dims.describe() == "pp=1 dp_replicate=1 dp_shard=2 tp=2 (world 4)"
    assert dims.fsdp_enabled and dims.tp_enabled and not dims.pp_enabled
    assert dims.fsdp_mesh_axes == ("dp_shard",)
    assert ParallelDims(4, dp_replicate=2, dp_shard=2).fsdp_mesh_axes == ("dp_replicate", "dp_shard")


def test_mesh_before_build_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="before build_mesh"):
        _ = ParallelDims(1).mesh


def test_tp_minus_one_takes_the_rest_and_only_one_degree_may() -> None:
    assert ParallelDims(8, dp_shard=2, tp=-1).tp == 4
    assert ParallelDims(8, dp_shard=1, tp=-1, pp=2).tp == 4
    with pytest.raises(ValueError, match=r"dp_shard=-1 and tp=-1: only one data-parallel degree \(or tp\)"):
        ParallelDims(8, dp_shard=-1, tp=-1)
