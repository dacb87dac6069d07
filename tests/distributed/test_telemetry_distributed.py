"""Telemetry on CPU (gloo): per-axis communication counts, bytes and time against known values, and tokens/s.

Each layout runs twice in the same ranks: as is, and with a known sleep added under the tracker to one axis's
collectives (where a slow link would show). The extra time must land on that axis (calls x delay, between 3/4 and 3/2
of it, in each run's quickest step or logging window, which load cannot make quicker) and no other; counts and bytes
must match what the model implies (5%).

- dp through Lightning's DDPStrategy: ``test_telemetry_ddp.py``.
- dp (FSDP2 ``fully_shard``) and tp (DTensor) through raw torch on a 2 x 2 mesh (dp_shard x tp), the same torch
  calls our TensorParallelStrategy makes.
- pp through ``torch.distributed.pipelining`` (ScheduleGPipe) on 2 ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from injected_delay import DELAY, check_added, slow_down
from torch import nn

from lightning_dist._compat import functional_collectives_module
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.run.launch import launch
from lightning_dist.telemetry import CommTracker, OpStats, axis_groups_from_mesh
from lightning_dist.telemetry.torch_patches import c10d_name, funcol_name


def _per_axis(stats: dict[tuple[str, str], OpStats], steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (axis, op), s in stats.items():
        entry = out.setdefault(axis, {"ms": 0.0})
        entry["ms"] += s.seconds * 1e3 / steps
        entry[f"{op}_calls"] = s.count / steps
        entry[f"{op}_bytes"] = s.bytes / steps
    return out


def _axis_ms(stats: dict[tuple[str, str], OpStats]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (axis, _op), s in stats.items():
        totals[axis] = totals.get(axis, 0.0) + s.seconds * 1e3
    return totals


def _measure(tracker: CommTracker, step: Callable[[], None], warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """Calls and bytes per step, and each axis's time in its quickest step: load only ever adds time (a rank
    descheduled, a peer late), so the quickest of a few steps is the one it touched least."""
    for _ in range(warmup):  # first steps do lazy init (FSDP) and shape exchange (pipelining)
        step()
    dist.barrier()
    quickest: dict[str, float] = {}
    with tracker:
        before: dict[str, float] = {}
        for _ in range(steps):
            step()
            now = _axis_ms(tracker.snapshot())
            for axis, ms in now.items():
                quickest[axis] = min(quickest.get(axis, float("inf")), ms - before.get(axis, 0.0))
            before = now
        stats = tracker.snapshot()
    out = _per_axis(stats, steps)
    for axis, entry in out.items():
        entry["ms"] = quickest[axis]
    return out


# ------------------------------------------------------------------------------- counted-only vs timed collectives
LATE = 0.3  # seconds rank 1 arrives late at the all-reduce


def _timing_rank() -> dict[bool, dict[str, float]]:
    dist.init_process_group("gloo")
    tensor, results = torch.ones(4), {}
    for timing in (False, True):
        tracker = CommTracker(timing=timing)
        dist.barrier()
        with tracker:
            if dist.get_rank() == 1:
                time.sleep(LATE)
            start = time.perf_counter()
            work = dist.all_reduce(tensor, async_op=True)
            returned_after = time.perf_counter() - start
            work.wait()
            stats = tracker.snapshot()[("dp", "all_reduce")]
        results[timing] = {
            "returned_after": returned_after,
            "calls": stats.count,
            "bytes": stats.bytes,
            "timed_calls": stats.timed_count,
            "seconds": stats.seconds,
        }
    results["ep=dp_shard"] = _ep_on_dp_ranks()
    dist.destroy_process_group()
    return results


def _ep_on_dp_ranks() -> set[tuple[str, str]]:
    """ep = dp_shard = 2: the experts' all-to-all and FSDP2's all-gather on one set of ranks (torch's groups for the
    ``ep``, ``dp_shard`` and ``dp`` axes), each under its own axis."""
    dims = ParallelDims(2, dp_shard=2, ep=2)
    dims.build_mesh("cpu")
    tracker = CommTracker(axis_groups_from_mesh(dims.mesh), timing=False)
    with tracker:
        dist.all_to_all_single(torch.empty(4), torch.ones(4), group=dims.group("ep"))
        for axis in ("ep", "dp_shard", "dp"):  # FSDP2 gathers over the dp_shard mesh, whichever object holds it
            dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=dims.group(axis))
    return set(tracker.snapshot())


@pytest.fixture(scope="module")
def timing_rank() -> dict[Any, Any]:
    return launch(_timing_rank, 2)[0]


def test_ep_on_the_data_parallel_ranks_reports_its_all_to_alls_under_ep_and_the_rest_under_dp(timing_rank) -> None:
    assert timing_rank["ep=dp_shard"] == {("ep", "all_to_all"), ("dp", "all_gather")}


def test_an_untimed_collective_is_counted_but_not_waited_for(timing_rank) -> None:
    untimed, timed = timing_rank[False], timing_rank[True]  # rank 0 waits LATE for rank 1 in the collective
    assert untimed["calls"] == timed["calls"] == 1 and untimed["bytes"] == timed["bytes"] == 4 * 4
    # Untimed: async_op returns at once (the overlap with compute is kept) and no time is recorded.
    assert untimed["returned_after"] < LATE / 3
    assert untimed["timed_calls"] == 0 and untimed["seconds"] == 0
    # Timed on CPU: the wrapper waits, so the call takes as long as the collective.
    assert timed["returned_after"] == pytest.approx(LATE, rel=0.5)
    assert timed["timed_calls"] == 1 and timed["seconds"] == pytest.approx(timed["returned_after"], rel=0.05)


# ------------------------------------------------------------------------------------ FSDP2 + TP on a 2 x 2 mesh
D, H, LAYERS, BATCH = 16, 32, 2, 8


def _fsdp_tp_rank() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    dims = ParallelDims(4, dp_replicate=1, dp_shard=2, tp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(LAYERS)])
    local_param_bytes = []  # per block, tp-sharded but not yet dp-sharded: what FSDP all-gathers
    for block in model:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        local_param_bytes.append(sum(p.to_local().numel() * 4 for p in block.parameters()))
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=False)
    generator = torch.Generator().manual_seed(dims.dp_rank(dist.get_rank()))  # same batch on both tp ranks
    batch = torch.randn(BATCH, D, generator=generator)

    def step() -> None:
        model(batch).pow(2).mean().backward()
        model.zero_grad()

    groups = axis_groups_from_mesh(mesh)
    resolver = CommTracker(groups)  # not installed: used only to tell the axes apart when injecting delays
    base = _measure(CommTracker(groups), step, warmup=2, steps=3)
    funcol = functional_collectives_module()
    is_tp = lambda group: resolver.axis_of(group)[0] == "tp"  # noqa: E731
    names = {"all_reduce": 2, "all_gather_single": 2, "reduce_scatter_single": 3}  # torch 2.13's, with group positions
    restore = slow_down(funcol, {funcol_name(name): pos for name, pos in names.items()}, is_tp)
    slow_tp = _measure(CommTracker(groups), step, warmup=0, steps=3)
    restore()
    is_dp = lambda group: resolver.axis_of(group)[0] == "dp"  # noqa: E731
    restore = slow_down(dist, {c10d_name(name): pos for name, pos in names.items()}, is_dp)
    slow_dp = _measure(CommTracker(groups), step, warmup=0, steps=3)
    restore()
    dist.destroy_process_group()
    return {"base": base, "slow_tp": slow_tp, "slow_dp": slow_dp, "block_bytes": local_param_bytes}


@pytest.fixture(scope="module")
def fsdp_tp() -> list[dict[str, Any]]:
    return launch(_fsdp_tp_rank, 4)


def test_fsdp_tp_counts_and_bytes_match_the_model(fsdp_tp: list[dict[str, Any]]) -> None:
    for rank in fsdp_tp:
        tp, dp = rank["base"]["tp"], rank["base"]["dp"]
        # TP: each block all-reduces its row-parallel output (forward) and its input gradient (backward), except
        # the first block, whose input needs no gradient: 2 x LAYERS - 1 all-reduces of a (BATCH, D) fp32 tensor.
        assert tp["all_reduce_calls"] == 2 * LAYERS - 1
        assert tp["all_reduce_bytes"] == pytest.approx((2 * LAYERS - 1) * BATCH * D * 4, rel=0.05)
        # FSDP2 without resharding: one all-gather and one reduce-scatter per block; nccl-tests size = the full
        # (unsharded over dp, tp-local) parameters of the block.
        assert dp["all_gather_calls"] == LAYERS
        assert dp["reduce_scatter_calls"] == LAYERS
        assert dp["all_gather_bytes"] == pytest.approx(sum(rank["block_bytes"]), rel=0.05)
        assert dp["reduce_scatter_bytes"] == pytest.approx(sum(rank["block_bytes"]), rel=0.05)


def _check_injected(base: dict, slow: dict, slowed: str, calls: float, others: list[str]) -> None:
    """The delay added to one axis's calls shows on that axis, once, and on no other. Bounds that load does not
    cross: each side's quickest step; a lower bound at 3/4 of the delay (the sleep is inside the timed call) and an
    upper one at 3/2 (counted twice it would be 2)."""
    check_added(slow[slowed]["ms"] - base[slowed]["ms"], calls * DELAY * 1e3)
    for axis in others:
        assert slow[axis]["ms"] - base[axis]["ms"] < 0.25 * calls * DELAY * 1e3, axis


def test_fsdp_tp_injected_delay_lands_on_its_axis(fsdp_tp: list[dict[str, Any]]) -> None:
    for rank in fsdp_tp:
        base = rank["base"]
        tp_calls = sum(v for k, v in base["tp"].items() if k.endswith("_calls"))
        dp_calls = sum(v for k, v in base["dp"].items() if k.endswith("_calls"))
        _check_injected(base, rank["slow_tp"], "tp", tp_calls, others=["dp"])
        _check_injected(base, rank["slow_dp"], "dp", dp_calls, others=["tp"])


# ------------------------------------------------------------------------------------------ pipelining on 2 ranks
MICROBATCHES, MB_SIZE = 4, 2


def _pp_rank() -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(2, dp_shard=1, pp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(rank)
    stage_module = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    # Shapes are inferred on the first step (a metadata exchange that the warmup steps keep out of the counts).
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(
        stage, n_microbatches=MICROBATCHES, loss_fn=lambda out, target: (out - target).pow(2).mean()
    )
    inputs = torch.randn(MICROBATCHES * MB_SIZE, D)

    def step() -> None:
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=torch.zeros(MICROBATCHES * MB_SIZE, D), losses=[])

    groups = axis_groups_from_mesh(mesh)
    base = _measure(CommTracker(groups), step, warmup=2, steps=3)
    restore = slow_down(dist, {"isend": 2, "irecv": 2}, lambda group: True)  # pp is the only axis here
    slow = _measure(CommTracker(groups), step, warmup=0, steps=3)
    restore()
    dist.destroy_process_group()
    return {"base": base, "slow": slow}


@pytest.fixture(scope="module")
def pipeline() -> list[dict[str, Any]]:
    return launch(_pp_rank, 2)


def test_pipeline_sends_match_microbatches_times_activation_bytes(pipeline: list[dict[str, Any]]) -> None:
    activation = MB_SIZE * D * 4
    first, last = pipeline[0]["base"]["pp"], pipeline[1]["base"]["pp"]
    # Stage 0 sends each microbatch's activation and receives its gradient; stage 1 the other way round.
    assert first["send_calls"] == first["recv_calls"] == last["send_calls"] == last["recv_calls"] == MICROBATCHES
    for stats in (first, last):
        assert stats["send_bytes"] == pytest.approx(MICROBATCHES * activation, rel=0.05)
        assert stats["recv_bytes"] == pytest.approx(MICROBATCHES * activation, rel=0.05)
    assert set(pipeline[0]["base"]) == {"pp"}  # nothing leaked to another axis


def test_pipeline_injected_delay_lands_on_pp(pipeline: list[dict[str, Any]]) -> None:
    for rank in pipeline:
        base = rank["base"]
        _check_injected(base, rank["slow"], "pp", base["pp"]["send_calls"] + base["pp"]["recv_calls"], others=[])
