"""Nothing between the step and the device: a step that does not log reads no more values back than a plain loop.

On a GPU every read of a device value (``item``, ``bool``, ``float``, ``tolist``, ...) or blocking host-side
collective (``barrier``, the ``*_object`` ones) makes the host wait for the device. The app's whole step (Lightning's
loop, ``GPTModule``, the strategy, the non-finite guard and every default callback: loss history, preemption,
heartbeat, telemetry) is counted on 2 ranks for DDP, FSDP2, TP, PP and DiLoCo (between its outer steps), against a
plain torch loop that trains the same GPT under the same layout (forward, backward, clip by the global norm, fused
AdamW, LR schedule). Counted per optimizer step, over steps whose window holds no logging step
(``trainer.log_every_n_steps=4``).

Host-to-device transfers are counted too (:class:`HostTransfers`), which no read of a value shows: a tensor made
from host data (``torch.tensor([flag], device=...)`` copies pageable host memory to the GPU, which blocks the host)
and a blocking copy of such a tensor to a device (``.to(device)``, ``.cuda()``, ``copy_``). On this CPU machine
source and target are the same memory, so the counter goes by the call, not by the devices.

One read is allowed by name: the preemption flag agreed by a non-blocking all-reduce started a step earlier
(``callbacks/preemption.py``: on CUDA it is a read of pinned host memory behind an event, not of device memory).
"""

from __future__ import annotations

import csv
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import FAST, compose_config, losses, run_app
from torch.overrides import TorchFunctionMode

from lightning_dist.callbacks.preemption import _Agreement
from lightning_dist.parallel.expert import ExpertDispatch
from lightning_dist.run.launch import launch

READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu")
BLOCKING = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
ALLOWED = {_Agreement.value.__code__}  # the preemption flag, read one step after its collective started
LOG_EVERY, STEPS = 4, 9
QUIET_STEPS = (2, 3, 6, 7)  # neither the step nor the one before it logs (the loop logs after on_train_batch_end)
LAYOUTS = {
    "ddp": ["parallelism=ddp"],
    "fsdp2": ["parallelism=fsdp"],
    "tp2": ["parallelism=tp"],
    "pp2": ["parallelism=pp"],
    # DiLoCo's outer step after step 5 (not a quiet step: on CUDA it reads the averaged pseudo-gradient back into the
    # host backup, inherently); steps 6 and 7 check that nothing of it (its timing events) is read later
    "diloco": ["parallelism=diloco", "parallelism.diloco.every=5"],
    # MoE blocks with their experts split over ep=2; the plain loop trains the same MoE GPT under FSDP2 (no ep)
    "ep2": ["model=moe_tiny", "parallelism=ep"],
}
#: The one read expert parallelism needs: each MoE block's forward reads its all-to-all's split sizes (dropless
#: routing: how many rows go to each rank is known on the device only). Counted apart, and exactly.
SPLIT_SIZES = ExpertDispatch._dispatch_and_combine.__code__
SETTINGS = [
    "logger=none",
    "trainer.enable_checkpointing=false",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=0",
    f"trainer.max_steps={STEPS}",
    f"trainer.log_every_n_steps={LOG_EVERY}",
    "telemetry.report=false",
    "data.global_batch_size=8",
    "data.seq_len=32",
    "data.num_train_samples=256",
    "model.max_seq_len=64",
]


#: Tensors made from host data (Python numbers, lists, NumPy arrays): on a GPU a host-to-device copy of pageable
#: memory, which the host waits for.
FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
#: Copies to another device; on a GPU blocking unless ``non_blocking=True`` (Lightning's batch transfer is).
COPIES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


class HostTransfers(TorchFunctionMode):
    """Counts, into ``reads.transfers``, what would move host data to the device in a step: every tensor made from
    host data, and every blocking copy of such a tensor (made by ``FROM_HOST``, tracked weakly) to a device."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self._from_host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # by id

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.reads._active:
            return result
        if func in FROM_HOST:
            self._from_host[id(result)] = result
            self.reads.count_transfer(func.__name__)
        elif func in COPIES and not kwargs.get("non_blocking", False):
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            if self._from_host.get(id(source)) is source and result is not source:
                self.reads.count_transfer(func.__name__)
        return result


# A read's wrapper runs again from inside the mode (torch routes Tensor.item & co. through __torch_function__): that
# second call is the same read, already counted where the caller made it.
ALLOWED.add(HostTransfers.__torch_function__.__code__)


class HostReads:
    """Counts reads of tensor values and blocking host-side collectives (``count``), and host-to-device transfers
    (``transfers``, see :class:`HostTransfers`), in this process, while ``counting``."""

    def __init__(self) -> None:
        self.count = 0
        self.split_sizes = 0  # reads by SPLIT_SIZES
        self.transfers = 0
        self.where: list[str] = []  # the first few callers, for the failure message
        self._active = False

    def count_transfer(self, name: str) -> None:
        self.transfers += 1
        if len(self.where) < 20:
            caller = sys._getframe(2)  # count_transfer <- __torch_function__ <- the torch function's caller
            self.where.append(f"transfer {name} from {caller.f_code.co_filename}:{caller.f_lineno}")

    def _wrap(self, owner: Any, name: str) -> Callable[[], None]:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                caller = sys._getframe(1)
                if caller.f_code is SPLIT_SIZES:
                    self.split_sizes += 1
                elif caller.f_code not in ALLOWED:
                    self.count += 1
                    if len(self.where) < 20:
                        self.where.append(f"{name} from {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        return lambda: setattr(owner, name, original)

    @contextmanager
    def installed(self) -> Iterator[HostReads]:
        undo = [self._wrap(torch.Tensor, name) for name in READS] + [self._wrap(dist, name) for name in BLOCKING]
        try:
            yield self
        finally:
            for restore in undo:
                restore()

    @contextmanager
    def counting(self) -> Iterator[None]:
        self._active = True
        try:
            with HostTransfers(self):
                yield
        finally:
            self._active = False


class CountSteps(pl.Callback):
    """The count between the ends of consecutive optimizer steps (everything Lightning and the callbacks did)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads, self.per_step, self.transfers, self.where, self._last = reads, {}, {}, {}, (0, 0, 0)
        self.split_sizes: dict[int, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step, (reads, transfers, split_sizes) = trainer.global_step, self._last
        self.per_step[step] = self.reads.count - reads
        self.transfers[step] = self.reads.transfers - transfers
        self.split_sizes[step] = self.reads.split_sizes - split_sizes
        self.where[step] = list(self.reads.where)
        self._last = (self.reads.count, self.reads.transfers, self.reads.split_sizes)
        self.reads.where.clear()


def _library(cfg: Any, reads: HostReads) -> dict[str, Any]:
    from lightning_dist.run.fit import fit

    counter = CountSteps(reads)
    with reads.counting():
        fit(cfg, callbacks=[counter])
    return {"per_step": counter.per_step, "transfers": counter.transfers, "where": counter.where,
            "split_sizes": counter.split_sizes}  # fmt: skip


def _plain(layout: str, cfg: Any, reads: HostReads) -> dict[str, Any]:
    """The same GPT, batches and update in a plain torch loop under the same layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from lightning_dist.config.build import build_datamodule, build_module
    from lightning_dist.models.gpt_parallel import gpt_tensor_parallel_plan
    from lightning_dist.models.loss import token_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    datamodule = build_datamodule(cfg)
    datamodule.setup("fit")
    module = build_module(cfg)
    module.configure_model()
    model = module.model
    context = torch.enable_grad
    if layout == "ddp":
        model = DistributedDataParallel(model)
    elif layout in ("fsdp2", "ep2"):
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "diloco":
        pass  # between outer steps every replica trains alone
    elif layout == "tp2":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, gpt_tensor_parallel_plan(""))
        context = loss_parallel
    else:  # pp2: stage 0 = embeddings + first half of the blocks, stage 1 = the rest + norm + head
        keys = list(model.layers.keys())
        half = len(keys) // 2
        for key in keys[half:] if rank == 0 else keys[:half]:
            del model.layers[key]
        for name in ("norm", "head") if rank == 0 else ("tok_emb", "pos_emb"):
            setattr(model, name, None)
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=token_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    per_step: dict[int, int] = {}
    transfers: dict[int, int] = {}
    for step, (inputs, targets) in enumerate(datamodule.train_dataloader(), start=1):
        if step > STEPS:
            break
        before, transfers_before = reads.count, reads.transfers
        with reads.counting():
            if layout == "pp2":
                if rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=targets, losses=[])
            else:
                with context():
                    token_loss(model(inputs), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        per_step[step] = reads.count - before
        transfers[step] = reads.transfers - transfers_before
    return {"per_step": per_step, "transfers": transfers}


def _all_layouts(configs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    reads, results = HostReads(), {}
    with reads.installed():
        for layout, cfg in configs.items():
            reads.where.clear()
            results[layout] = {"library": _library(cfg, reads), "plain": _plain(layout, cfg, reads)}
    return results


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    configs = {
        name: compose_config([*SETTINGS, *overrides], tmp_path_factory.mktemp(name)) for name, overrides in
        LAYOUTS.items()
    }  # fmt: skip
    return launch(_all_layouts, 2, configs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_does_not_log_reads_no_more_than_a_plain_loop(counts: list[dict[str, Any]], layout: str) -> None:
    for rank, result in enumerate(counts):
        library, plain = result[layout]["library"], result[layout]["plain"]
        ours = {step: library["per_step"][step] for step in QUIET_STEPS}
        theirs = max(plain["per_step"][step] for step in QUIET_STEPS)
        assert max(ours.values()) <= theirs, (
            f"rank {rank}, {layout}: host reads per step {ours} vs the plain loop's {theirs}; in step "
            f"{QUIET_STEPS[-1]}: {library['where'][QUIET_STEPS[-1]]}"
        )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_does_not_log_moves_no_more_host_data_to_the_device_than_a_plain_loop(
    counts: list[dict[str, Any]], layout: str
) -> None:
    for rank, result in enumerate(counts):
        library, plain = result[layout]["library"], result[layout]["plain"]
        ours = {step: library["transfers"][step] for step in QUIET_STEPS}
        theirs = max(plain["transfers"][step] for step in QUIET_STEPS)
        assert max(ours.values()) <= theirs, (
            f"rank {rank}, {layout}: host-to-device transfers per step {ours} vs the plain loop's {theirs}; in step "
            f"{QUIET_STEPS[-1]}: {library['where'][QUIET_STEPS[-1]]}"
        )


def test_expert_parallelism_reads_its_split_sizes_once_per_moe_block_forward(counts: list[dict[str, Any]]) -> None:
    """The one read ep adds, counted: moe_tiny's 2 MoE blocks, one forward each per step (no accumulation, no
    activation checkpointing); ``_dispatch_and_combine`` reading once more (a count read apart) fails it."""
    for rank, result in enumerate(counts):
        split_sizes = result["ep2"]["library"]["split_sizes"]
        assert {step: split_sizes[step] for step in QUIET_STEPS} == dict.fromkeys(QUIET_STEPS, 2), (rank, split_sizes)


def test_logging_steps_are_counted(counts: list[dict[str, Any]]) -> None:
    """The counter sees the reads a logging step makes (the loss reduced and read): it can fail."""
    for result in counts:
        for layout in LAYOUTS:
            steps = result[layout]["library"]["per_step"]
            assert steps[LOG_EVERY] > 0 and steps[2 * LOG_EVERY] > 0, (layout, steps)
            # Lightning's log() of a float (train/lr) makes a device tensor from it: the transfer counter sees it.
            transfers = result[layout]["library"]["transfers"]
            assert transfers[LOG_EVERY] > 0 and transfers[2 * LOG_EVERY] > 0, (layout, transfers)


def test_plain_loops_train(counts: list[dict[str, Any]]) -> None:
    for result in counts:
        assert all(len(result[layout]["plain"]["per_step"]) == STEPS for layout in LAYOUTS)


def _logged_losses(result: dict[str, Any]) -> dict[int, float]:
    with Path(result["csv"]).open() as file:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")}


def test_logging_every_few_steps_changes_no_value(tmp_path: Path) -> None:
    """The loggers get the same values, and the history still has every step's loss, when only every third step
    reads them back (pp2 x dp2: the loss comes from the last stage, the mean over the data-parallel ranks)."""
    layout = ["parallelism=pp", "cluster.devices=4", "trainer.max_steps=7", "logger=csv"]
    every = run_app([*FAST, *layout, "trainer.log_every_n_steps=1"], tmp_path / "every")
    third = run_app([*FAST, *layout, "trainer.log_every_n_steps=3"], tmp_path / "third")
    logged_every, logged_third = _logged_losses(every), _logged_losses(third)
    # Lightning's CSV rows count steps from 0: steps 3 and 6, and no other, reached the logger, with the same values.
    assert logged_third == {2: logged_every[2], 5: logged_every[5]}
    assert len(losses(third)) == 7
    # The history reduces a window of steps in one all-reduce: gloo may sum a vector in another order than a scalar.
    np.testing.assert_allclose(losses(third), losses(every), rtol=1e-6)
    np.testing.assert_allclose(losses(third)[2], logged_every[2], rtol=1e-6)
    grad_norms = [r["step"] for r in third["history"] if "train/grad_norm" in r]
    assert grad_norms == [3.0, 6.0, 7.0]  # logged on logging steps and the last one
