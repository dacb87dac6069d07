"""The non-finite guard decides on the device with a fused optimizer: no host read outside logging steps.

A fused AdamW honours ``optimizer.found_inf`` (as under ``torch.amp.GradScaler``): a NaN gradient at step k leaves
parameters, moments and the step counter as they were, and the strategy's step reads nothing on the host (counted by
wrapping every ``Tensor`` method that reads a value: ``item``, ``bool``, ``float``, ``int``, ``index``, ``tolist``).
The device's count is read on logging steps, before checkpoint saves and at the end of training.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dist.callbacks.checkpoints import RunCheckpoints
from lightning_dist.errors import NonFiniteError
from lightning_dist.parallel.clip import global_grad_norm
from lightning_dist.strategies import DataParallelStrategy, MeshStrategy

LOG_EVERY = 5
READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist")


class _Regression(pl.LightningModule):
    """A linear regression whose loss is made NaN at ``bad_steps`` (1-based optimizer steps)."""

    def __init__(self, bad_steps: tuple[int, ...] = (), fused: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.bad_steps, self.fused = set(bad_steps), fused

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        return loss * math.nan if self.trainer.global_step + 1 in self.bad_steps else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1, fused=True)
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1, foreach=True)


def _data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class _HostReads:
    """Counts host reads of tensor values while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.active = 0, False
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))

    def _counting(self, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.count += 1
            return original(tensor, *args, **kwargs)

        return read

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.count, self.active = 0, True
        try:
            yield
        finally:
            self.active = False


class _Snapshots(pl.Callback):
    """Parameters and optimizer state before and after each optimizer step (1-based)."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before[trainer.global_step + 1] = _state(trainer, module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.after[trainer.global_step] = _state(trainer, module)


def _state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    out = {f"param.{name}": p.detach().clone() for name, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    for index, p in enumerate(module.parameters()):
        for key, value in optimizer.state.get(p, {}).items():
            out[f"state.{index}.{key}"] = value.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


#: What a launcher (ours, torchrun, SLURM, submitit, Lightning's own) leaves in os.environ: another test in this
#: pytest worker may have set them, and a one-device Trainer would then wait for ranks that never come.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
                "SLURM_STEP_ID", "SUBMITIT_EXECUTOR", "LIGHTNING_DIST_LAUNCHER_PID")  # fmt: skip


@pytest.fixture(autouse=True)
def _a_fresh_single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test is one process of its own: no launcher's variables before it, none of what Lightning's launcher sets
    (MASTER_PORT, WORLD_SIZE, ...) after it, and no process group left behind."""
    saved = dict(os.environ)
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _trainer(strategy: Any, max_steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        log_every_n_steps=LOG_EVERY,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )


def _strategy(kind: str, action: str) -> Any:
    if kind == "ddp":
        return DataParallelStrategy(on_nonfinite=action)
    return MeshStrategy(on_nonfinite=action)


def _count_strategy_steps(trainer: pl.Trainer, reads: _HostReads, monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Host reads in each of the strategy's optimizer steps (closure, norm, guard and optimizer), by step."""
    strategy, per_step = trainer.strategy, {}
    original = strategy.optimizer_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        step = trainer.global_step + 1
        try:
            with reads.counting():
                return original(*args, **kwargs)
        finally:
            per_step[step] = reads.count

    monkeypatch.setattr(strategy, "optimizer_step", counted)
    return per_step


def _plain_loop_reads(reads: _HostReads, steps: int, bad_step: int = 0, fused: bool = True) -> list[int]:
    """The same math without Lightning: forward, backward, the norm, AdamW's step; host reads per step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    kind = {"fused": True} if fused else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, **kind)
    counts = []
    for step, (x, y) in enumerate(_data(), start=1):
        if step > steps:
            break
        with reads.counting():
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            (loss * math.nan if step == bad_step else loss).backward()
            global_grad_norm(model.parameters())
            optimizer.step()
        counts.append(reads.count)
    return counts


@pytest.mark.parametrize("kind", ["ddp", "mesh"])
def test_a_nan_step_is_skipped_on_the_device_without_host_reads(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bad, steps = 3, 8
    reads = _HostReads(monkeypatch)
    snapshots = _Snapshots()
    trainer = _trainer(_strategy(kind, "skip"), steps, [snapshots])
    per_step = _count_strategy_steps(trainer, reads, monkeypatch)
    with pytest.warns(UserWarning, match=r"1 update\(s\) skipped on the device .* at step 5: the first at step 3"):
        trainer.fit(_Regression(bad_steps=(bad,)), _data())

    assert trainer.global_step == steps  # skip trains to the end; the skipped step still counts
    assert _same(snapshots.before[bad], snapshots.after[bad])  # parameters, both moments and the step counter
    assert not _same(snapshots.before[bad + 1], snapshots.after[bad + 1])  # the next step is applied
    assert all(torch.isfinite(value).all() for value in snapshots.after[steps].values())
    state = trainer.optimizers[0].state[next(trainer.lightning_module.parameters())]
    assert int(state["step"]) == steps - 1
    assert trainer.strategy.nonfinite_guard.skipped == 1

    plain = _plain_loop_reads(reads, steps, bad)
    quiet = {step: count for step, count in per_step.items() if step % LOG_EVERY}
    print(f"host reads per step, {kind} strategy: {per_step}; plain fused AdamW loop: {plain}")
    assert sorted(quiet) == [1, 2, 3, 4, 6, 7, 8]
    assert quiet == {step: plain[step - 1] for step in quiet} == dict.fromkeys(quiet, 0)
    assert per_step[LOG_EVERY] > 0  # the logging step reads the device's count


def test_without_a_fused_optimizer_the_guard_reads_the_norm_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _HostReads(monkeypatch)
    trainer = _trainer(_strategy("ddp", "skip"), 4, [])
    per_step = _count_strategy_steps(trainer, reads, monkeypatch)
    trainer.fit(_Regression(fused=False), _data())
    plain = _plain_loop_reads(reads, 4, fused=False)  # foreach AdamW reads its (CPU) step counters itself
    print(f"host reads per step, foreach AdamW: ddp strategy {per_step}; plain loop {plain}")
    assert per_step == {step: plain[step - 1] + 1 for step in per_step}  # the fallback: one bool(isfinite(norm))


@pytest.mark.parametrize("kind", ["ddp", "mesh"])
def test_stop_raises_at_the_next_logging_step_naming_the_first_bad_step(kind: str) -> None:
    snapshots = _Snapshots()
    trainer = _trainer(_strategy(kind, "stop"), 8, [snapshots])
    with pytest.raises(NonFiniteError, match=r"^step 3: gradient norm nan \(loss nan\) is not finite; .*at step 5"):
        trainer.fit(_Regression(bad_steps=(3,)), _data())
    assert trainer.global_step == 4  # raised in step 5's optimizer step
    after = _state(trainer, trainer.lightning_module)
    assert _same(snapshots.before[3], after)  # neither step 3 nor any step after it was applied


def test_stop_raises_before_a_checkpoint_is_written(tmp_path: Path) -> None:
    checkpoints = RunCheckpoints(tmp_path, every_n_steps=2)
    trainer = _trainer(_strategy("ddp", "stop"), 8, [checkpoints])
    with pytest.raises(NonFiniteError, match=r"^step 3: gradient norm nan .* is not finite; .*at step 4"):
        trainer.fit(_Regression(bad_steps=(3,)), _data())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step-00000002"]


def test_stop_raises_at_the_end_of_training_without_a_logging_step() -> None:
    trainer = _trainer(_strategy("ddp", "stop"), 4, [])  # steps 1-4: no logging step (every 5)
    with pytest.raises(NonFiniteError, match=r"^step 4: gradient norm nan .* is not finite"):
        trainer.fit(_Regression(bad_steps=(4,)), _data())


@pytest.mark.gpu
def test_non_logging_steps_do_not_synchronize_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=DataParallelStrategy(on_nonfinite="skip"), max_steps=8,
        log_every_n_steps=LOG_EVERY, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False,
    )  # fmt: skip
    strategy, checked = trainer.strategy, []
    original = strategy.optimizer_step

    def strict(optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        step = trainer.global_step + 1
        if step % LOG_EVERY == 0:
            return original(optimizer, closure, model, **kwargs)
        loss = closure()  # forward and backward (the batch was copied to the GPU before)
        torch.cuda.set_sync_debug_mode("error")
        try:  # the norm, the device-side decision and fused AdamW's step: no synchronization
            result = original(optimizer, lambda: loss, model, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(step)
        return result

    monkeypatch.setattr(strategy, "optimizer_step", strict)
    trainer.fit(_Regression(bad_steps=(3,)), _data())
    assert checked == [1, 2, 3, 4, 6, 7, 8]
    assert trainer.strategy.nonfinite_guard.skipped == 1
