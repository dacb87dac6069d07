"""Telemetry on CPU (gloo): per-axis communication counts, bytes and time against known values, and tokens/s.

Each layout runs twice in the same ranks: as is, and with a known sleep added under the tracker to one axis's
collectives (where a slow link would show). The extra time must land on that axis (calls x delay, within 25%, which
machine load stays inside) and no other; counts and bytes must match what the model implies (5%).

- dp through Lightning's DDPStrategy (C++ reducer -> our comm hook) with the full ``Telemetry`` callback.
- dp (FSDP2 ``fully_shard``) and tp (DTensor) through raw torch on a 2 x 2 mesh (dp_shard x tp), the same torch
  calls our TensorParallelStrategy makes.
- pp through ``torch.distributed.pipelining`` (ScheduleGPipe) on 2 ranks.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dist._compat import functional_collectives_module
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.run.launch import launch
from lightning_dist.telemetry import CommTracker, OpStats, Telemetry, axis_groups_from_mesh

DELAY = 0.1  # s per slowed call: large next to what load adds (a busy 2-core run measured +28 ms on a 20 ms delay)


# ------------------------------------------------------------------------------------------------------ helpers
def _slow_down(module: Any, group_pos: dict[str, int], slow_if: Callable[[Any], bool]) -> Callable[[], None]:
    """Make ``module.<name>`` sleep ``DELAY`` before calls whose group (argument ``group_pos[name]``) is ``slow_if``.

    Runs before the tracker installs, so the tracker times the slow version (as it would a slow link). The same
    function object is replaced on torch.distributed and distributed_c10d, as the tracker expects. Returns the undo.
    """
    undo = []
    for name, pos in group_pos.items():
        original = getattr(module, name)

        def slow(*args: Any, _fn: Callable = original, _pos: int = pos, **kwargs: Any) -> Any:
            if slow_if(kwargs["group"] if "group" in kwargs else args[_pos] if len(args) > _pos else None):
                time.sleep(DELAY)
            return _fn(*args, **kwargs)

        for holder in (module, dist, dist.distributed_c10d):
            if getattr(holder, name, None) is original:
                setattr(holder, name, slow)
                undo.append((holder, name, original))

    def restore() -> None:
        for holder, name, original in reversed(undo):
            setattr(holder, name, original)

    return restore


def _per_axis(stats: dict[tuple[str, str], OpStats], steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for (axis, op), s in stats.items():
        entry = out.setdefault(axis, {"ms": 0.0})
        entry["ms"] += s.seconds * 1e3 / steps
        entry[f"{op}_calls"] = s.count / steps
        entry[f"{op}_bytes"] = s.bytes / steps
    return out


def _measure(tracker: CommTracker, step: Callable[[], None], warmup: int, steps: int) -> dict[str, dict[str, float]]:
    for _ in range(warmup):  # first steps do lazy init (FSDP) and shape exchange (pipelining)
        step()
    dist.barrier()
    with tracker:
        for _ in range(steps):
            step()
        stats = tracker.snapshot()
    return _per_axis(stats, steps)


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
    dist.destroy_process_group()
    return results


def test_an_untimed_collective_is_counted_but_not_waited_for() -> None:
    untimed, timed = launch(_timing_rank, 2)[0].values()  # rank 0 waits LATE for rank 1 in the collective
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
    restore = _slow_down(funcol, {"all_reduce": 2, "all_gather_single": 2, "reduce_scatter_single": 3}, is_tp)
    slow_tp = _measure(CommTracker(groups), step, warmup=0, steps=3)
    restore()
    is_dp = lambda group: resolver.axis_of(group)[0] == "dp"  # noqa: E731
    restore = _slow_down(dist, {"all_gather_single": 2, "reduce_scatter_single": 3, "all_reduce": 2}, is_dp)
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
    added = calls * DELAY * 1e3
    assert slow[slowed]["ms"] - base[slowed]["ms"] == pytest.approx(added, rel=0.25)
    for axis in others:
        assert abs(slow[axis]["ms"] - base[axis]["ms"]) < 0.25 * added, axis


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
    restore = _slow_down(dist, {"isend": 2, "irecv": 2}, lambda group: True)  # pp is the only axis here
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


# ----------------------------------------------------------------------- Lightning DDP with the Telemetry callback
VOCAB, WIDTH, SEQ, LOCAL_BATCH, STEPS, EVERY = 64, 32, 16, 4, 9, 4
STEP_SLEEP = 0.03  # makes step times steady, so the test's own clock and the callback's agree closely


class _TinyLM(pl.LightningModule):
    """Embedding + head; records, independently of the telemetry, each step's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.step_tokens: list[int] = []
        self.flops_per_token = 6 * sum(p.numel() for p in self.parameters())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        self.step_tokens.append(inputs.numel())
        time.sleep(STEP_SLEEP)
        logits = self.head(self.emb(inputs))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Clock(pl.Callback):
    """When each batch's ``on_train_batch_end`` reached this callback (the test's own clock)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def _fit_ddp(log_dir: str, name: str) -> tuple[Telemetry, _TinyLM]:
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * 2 * STEPS, SEQ + 1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=LOCAL_BATCH
    )
    module, telemetry = _TinyLM(), Telemetry(log_every_n_steps=EVERY, print_summary=False)
    # Around the telemetry's hook: its window runs from the end of one logging step's hook (after its log) to the
    # start of the next's, so the test's clock reads there, not across a step's other phases (data, a log's sync).
    module.clocks = (_Clock(), _Clock())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(),
        max_steps=STEPS,
        logger=CSVLogger(log_dir, name=name),
        callbacks=[module.clocks[0], telemetry, module.clocks[1]],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    return telemetry, module


def _ddp_rank(log_dir: str) -> dict[str, Any]:
    base, module = _fit_ddp(log_dir, "base")
    restore = _slow_down(dist, {"all_reduce": 2}, lambda group: group is not None)  # the DDP hook passes its group
    slow, _ = _fit_ddp(log_dir, "slow")
    restore()
    csv_dir = Path(log_dir) / "base" / "version_0"
    return {
        "base": base.history,
        "slow": slow.history,
        "grad_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        "ends_before": module.clocks[0].ends,  # each batch's end, just before the telemetry's hook
        "ends_after": module.clocks[1].ends,  # and just after it (its logging included)
        "step_tokens": module.step_tokens,
        "comm_table": base.tables["comm"],
        "csv_columns": _csv_columns(csv_dir / "metrics.csv") if dist.get_rank() == 0 else [],
        "csv_tables": sorted(p.name for p in csv_dir.glob("telemetry_*.csv")),
    }


def _csv_columns(path: Path) -> list[str]:
    with path.open() as handle:
        return next(csv.reader(handle))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_ddp_rank, 2, str(tmp_path_factory.mktemp("ddp")))


def test_ddp_all_reduce_bytes_equal_gradient_bytes(ddp: list[dict[str, Any]]) -> None:
    for rank in ddp:
        assert [record["step"] for record in rank["base"]] == [EVERY, 2 * EVERY]
        steady = rank["base"][1]  # the second window: no first-step setup in it
        assert steady["comm/dp/bytes"] == pytest.approx(rank["grad_bytes"], rel=0.05)
        # One all-reduce (a single bucket: the model is far below DDP's 25 MB bucket size) and the tiny broadcast
        # of Lightning's training loop (SIGTERM check) in each step.
        assert steady["comm/dp/calls"] == 2
        assert steady["comm/dp/ms_min"] <= steady["comm/dp/ms"] <= steady["comm/dp/ms_max"]
        assert 0 < steady["comm/fraction"] < 1
        # Timing is sampled on CPU: the last step of each window (steps 4 and 8); every step is counted.
        assert steady["comm/timed_steps"] == 1
        rows = {(row[0], row[1]): row for row in rank["comm_table"][1]}
        columns = rank["comm_table"][0]
        all_reduce = dict(zip(columns, rows[("dp", "all_reduce")]))
        # One gradient all-reduce per step (plus Lightning's own decisions outside steps); two of them timed.
        assert all_reduce["calls"] >= STEPS and all_reduce["timed_calls"] == STEPS // EVERY
        # Lightning's per-step SIGTERM broadcast runs before the step's first batch hook: timed with its step.
        broadcast = dict(zip(columns, rows[("dp", "broadcast")]))
        assert broadcast["calls"] == STEPS and broadcast["timed_calls"] == STEPS // EVERY
        assert "comm/tp/ms" not in steady and "comm/pp/ms" not in steady  # axes that do not exist stay out


def test_ddp_injected_delay_lands_on_dp(ddp: list[dict[str, Any]]) -> None:
    for rank in ddp:
        base, slow = rank["base"][1], rank["slow"][1]
        added = 1 * DELAY * 1e3  # only all_reduce is slowed: the one gradient bucket per step
        assert slow["comm/dp/ms"] - base["comm/dp/ms"] == pytest.approx(added, rel=0.25)


def test_ddp_tokens_per_second_matches_the_test_clock(ddp: list[dict[str, Any]]) -> None:
    rank = ddp[0]
    # Window 2 = steps 5..8: from the end of step 4's telemetry hook (after its logging) to the start of step 8's.
    # Read at the steps' starts, a data load and a logging sync jitter by 10% of the window on a busy machine.
    tokens = rank["step_tokens"]
    seconds = rank["ends_before"][2 * EVERY - 1] - rank["ends_after"][EVERY - 1]
    expected = sum(tokens[EVERY : 2 * EVERY]) * len(ddp) / seconds
    assert rank["base"][1]["perf/tokens_per_sec"] == pytest.approx(expected, rel=0.10)
    assert rank["base"][1]["perf/tokens_per_sec_per_device"] == pytest.approx(expected / len(ddp), rel=0.10)
    assert rank["base"][1]["perf/tflops_per_device"] > 0


def test_ddp_metrics_and_tables_reach_the_csv_logger(ddp: list[dict[str, Any]]) -> None:
    columns = ddp[0]["csv_columns"]
    for key in ("perf/step_ms", "perf/tokens_per_sec", "comm/dp/ms", "comm/dp/busbw_gbps", "memory/rss_gib"):
        assert key in columns
    assert ddp[0]["csv_tables"] == ["telemetry_comm.csv", "telemetry_layout.csv"]
    columns, rows = ddp[0]["comm_table"]
    assert ("dp", "all_reduce") in {(row[0], row[1]) for row in rows}
