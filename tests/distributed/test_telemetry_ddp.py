"""Telemetry through Lightning's DDPStrategy (C++ reducer -> our comm hook) with the full ``Telemetry`` callback on 2
CPU ranks: bytes and calls per step against the gradients, a known delay landing on ``dp``, tokens/s against the
test's own clock, and the metrics and tables reaching Lightning's CSV logger. The other layouts' telemetry:
``test_telemetry_distributed.py``.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from injected_delay import DELAY, check_added, slow_down
from torch import nn

from lightning_dist.run.launch import launch
from lightning_dist.telemetry import Telemetry

VOCAB, WIDTH, SEQ, LOCAL_BATCH, STEPS, EVERY = 64, 32, 16, 4, 13, 4
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
    restore = slow_down(dist, {"all_reduce": 2}, lambda group: group is not None)  # the DDP hook passes its group
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
        assert [record["step"] for record in rank["base"]] == [EVERY, 2 * EVERY, 3 * EVERY]
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
        # The quickest of the logging windows after the first (which holds the warm-up): load only adds time.
        base, slow = (min(window["comm/dp/ms"] for window in rank[run][1:]) for run in ("base", "slow"))
        check_added(slow - base, 1 * DELAY * 1e3)  # only all_reduce is slowed: the one gradient bucket per step


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
