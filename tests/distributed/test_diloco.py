"""DiLoCo over dp_replicate through the Trainer: exact against HSDP at H=1, replicas apart between outer steps and
equal after, Streaming DiLoCo's staggered and delayed fragments, int8 exchanges, a resume mid-cycle (with an
exchange in flight) that continues exactly, fsdp / tp / pp inside each replica, and a mid-cycle checkpoint resumed in
another inner layout (tp2 -> pp2) or, right after an outer step, with more replicas. One spawned group of 2 ranks and
one of 4 run every case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy
from lightning_dist.parallel.compression import chunk_numel, exchange_sizes, payload_bytes
from lightning_dist.parallel.pipeline import PipelineSpec
from lightning_dist.run.launch import launch
from lightning_dist.telemetry import Telemetry

WIDTH, SAMPLES, BATCH = 8, 16, 4  # per rank at dp=2: 2 steps an epoch
EXACT = {"every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}


class Net(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer = optimizer

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.compute_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.1)  # no momentum, no weight decay


class PipeNet(Net):
    """Net split into pipeline stages (net.0 | net.1, net.2) under pp."""

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", loss_fn=F.mse_loss)


class Record(pl.Callback):
    """Every parameter (whole) after each optimizer step."""

    def __init__(self) -> None:
        self.params: list[dict[str, np.ndarray]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in pl_module.named_parameters()}
        self.params.append({n: t.detach().numpy().copy() for n, t in whole.items()})


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=BATCH)


def _fit(root: Path, epochs: int, optimizer: str = "sgd", ckpt: Path | None = None, save: bool = False,
         telemetry: bool = False, module: type[Net] = Net, **strategy):  # fmt: skip
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if telemetry:  # logs at steps 2, 4, ...: the last record covers the whole run (every run has an even length)
        callbacks.append(Telemetry(log_every_n_steps=2, print_summary=False))
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1))
    strategy_obj = MeshStrategy(**strategy)
    degrees = strategy_obj.parallelism.degrees
    devices = degrees["dp_replicate"] * max(degrees["dp_shard"], 1) * degrees["tp"] * degrees["pp"]
    trainer = quiet_trainer(strategy_obj, devices,
                            max_steps=-1, callbacks=callbacks, max_epochs=epochs, default_root_dir=root,
                            enable_checkpointing=save)  # fmt: skip
    trainer.fit(module(optimizer), _loader(), ckpt_path=ckpt)
    diloco = strategy_obj.diloco
    out = {"params": record.params, "describe": "\n".join(strategy_obj.describe().lines())}
    if telemetry:
        out["telemetry"] = callbacks[-1].history
    if diloco is not None:
        out |= {"bytes_last": diloco.bytes_last_sync, "bytes_total": diloco.bytes_total, "numel": _local_numel(diloco)}
        out["fragments"] = diloco.fragments
    return out


def _local_numel(diloco: Any) -> int:
    return sum(t.numel() for t in diloco.backup.values())


def _two_ranks(root: str) -> dict[str, Any]:
    folder, replicas = Path(root), {"dp_replicate": 2, "dp_shard": 1}
    diloco = {**replicas, "sync": "diloco"}
    streaming = {**diloco, "every": 4, "fragments": 2}
    resumable = {**streaming, "delay": 1, "alpha": 0.25, "compression": "int8"}
    out = {
        "hsdp": _fit(folder / "hsdp", 2, telemetry=True, **replicas),
        "exact": _fit(folder / "exact", 2, telemetry=True, **diloco, **EXACT),
        "h3": _fit(folder / "h3", 3, telemetry=True, **diloco, every=3),
        "streaming": _fit(folder / "streaming", 4, **streaming),
        "delayed": _fit(folder / "delayed", 4, **streaming, delay=1),
        "int8": _fit(folder / "int8", 2, telemetry=True, **diloco, every=2, compression="int8"),
        "whole": _fit(folder / "whole", 3, "adamw", **resumable),
    }
    # epoch 1 ends at step 2: fragment 1 started there and is due at step 3 (in flight at the save)
    _fit(folder / "first", 1, "adamw", save=True, **resumable)
    ckpt = next((folder / "first").glob("epoch=0*"))
    out["resumed"] = _fit(folder / "resumed", 3, "adamw", ckpt=ckpt, **resumable)
    return out


def _four_ranks(root: str) -> dict[str, Any]:
    folder, layout = Path(root), {"dp_replicate": 2, "dp_shard": 2}
    tp = {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "plan": {"net.0": "colwise", "net.2": "rowwise"}}
    pp = {"dp_replicate": 2, "dp_shard": 1, "pp": 2, "module": PipeNet}
    out = {
        "hsdp": _fit(folder / "hsdp", 2, **layout),
        "exact": _fit(folder / "exact", 2, **layout, sync="diloco", **EXACT),
        # tensor parallelism inside each replica: the pseudo-gradient of each rank's tp shard (saved: it is at an
        # outer step after every inner step, where a resume may change dp_replicate)
        "sync_tp": _fit(folder / "sync_tp", 2, **tp),
        "exact_tp": _fit(folder / "exact_tp", 2, save=True, **tp, sync="diloco", **EXACT),
        "h2_tp": _fit(folder / "h2_tp", 2, **tp, sync="diloco", every=2),
        # pipeline stages inside each replica: the pseudo-gradient of each rank's stage
        "sync_pp": _fit(folder / "sync_pp", 2, **pp),
        "exact_pp": _fit(folder / "exact_pp", 2, **pp, sync="diloco", **EXACT),
        "h2_pp": _fit(folder / "h2_pp", 2, **pp, sync="diloco", every=2),
    }
    # a tp2 checkpoint of step 2 (an exchange in flight, due at 3; replicas and their AdamW states apart) resumed as pp2
    resumable = {"sync": "diloco", "every": 2, "delay": 1, "alpha": 0.25}
    out["whole_tp"] = _fit(folder / "whole_tp", 3, "adamw", **tp, **resumable, module=PipeNet)
    _fit(folder / "first_tp", 1, "adamw", save=True, **tp, **resumable, module=PipeNet)
    ckpt = next((folder / "first_tp").glob("epoch=0*"))
    out["resumed_pp"] = _fit(folder / "resumed_pp", 3, "adamw", ckpt=ckpt, **pp, **resumable)
    # dp_replicate 2 -> 4 right after an outer step: every replica starts from replica 0's state, as a synchronous run
    ckpt = next((folder / "exact_tp").glob("epoch=0*"))
    out["sync_r4"] = _fit(folder / "sync_r4", 2, ckpt=ckpt, dp_replicate=4, dp_shard=1)
    out["exact_r4"] = _fit(folder / "exact_r4", 2, ckpt=ckpt, dp_replicate=4, dp_shard=1, sync="diloco", **EXACT)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_two_ranks, 2, str(tmp_path_factory.mktemp("diloco")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_four_ranks, 4, str(tmp_path_factory.mktemp("diloco4")))


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: list[str] | None = None) -> bool:
    return all(np.array_equal(a[n], b[n]) for n in names or list(a))


def _assert_close(run: dict, reference: dict) -> None:
    assert len(run["params"]) == len(reference["params"]) > 0
    for step, (got, want) in enumerate(zip(run["params"], reference["params"])):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=f"step {step + 1} {name}")


def test_h1_outer_sgd_lr1_equals_hsdp(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        _assert_close(rank["exact"], rank["hsdp"])
    assert "DiLoCo over dp_replicate: H=1 F=1" in two_ranks[0]["exact"]["describe"]


def test_replicas_apart_between_outer_steps_and_equal_after(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = (rank["h3"]["params"] for rank in two_ranks)
    assert len(r0) == 6
    equal = [_same(a, b) for a, b in zip(r0, r1)]
    assert equal == [False, False, True, False, False, True]  # outer steps after inner steps 3 and 6
    numel = two_ranks[0]["h3"]["numel"]
    assert two_ranks[0]["h3"]["bytes_last"] == 4 * numel and two_ranks[0]["h3"]["bytes_total"] == 2 * 4 * numel


def test_streaming_fragments_sync_staggered(two_ranks: list[dict[str, Any]]) -> None:
    first, second = two_ranks[0]["streaming"]["fragments"]
    assert first == ["net.0.weight"] and second == ["net.0.bias", "net.2.weight", "net.2.bias"]  # 128 | 33 elements
    r0, r1 = (rank["streaming"]["params"] for rank in two_ranks)
    assert [_same(a, b, first) for a, b in zip(r0, r1)] == [False, False, False, True, False, False, False, True]
    assert [_same(a, b, second) for a, b in zip(r0, r1)] == [False, True, False, False, False, True, False, False]
    # tau = 1: a fragment's exchange starts at its step and lands one inner step later
    r0, r1 = (rank["delayed"]["params"] for rank in two_ranks)
    assert [_same(a, b, first) for a, b in zip(r0, r1)] == [False, False, False, False, True, False, False, False]
    assert [_same(a, b, second) for a, b in zip(r0, r1)] == [False, False, True, False, False, False, True, False]


def test_int8_exchange_keeps_replicas_equal_and_counts_bytes(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = (rank["int8"]["params"] for rank in two_ranks)
    assert [_same(a, b) for a, b in zip(r0, r1)] == [False, True, False, True]
    run = two_ranks[0]["int8"]
    # 161 elements: 2 chunks of one 256-element block each, int8 + 1 fp32 scale: an all-to-all and an all-gather of 2
    assert run["bytes_last"] == 2 * 2 * payload_bytes(chunk_numel(run["numel"], 2), "int8") == 2 * 2 * (256 + 4)
    assert run["bytes_total"] == 2 * run["bytes_last"]


def test_resume_mid_cycle_continues_exactly(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        whole, resumed = rank["whole"]["params"], rank["resumed"]["params"]
        assert len(whole) == 6 and len(resumed) == 4  # steps 3..6 after the checkpoint of step 2
        for step, (got, want) in enumerate(zip(resumed, whole[2:]), start=3):
            assert _same(got, want), f"step {step}"
        assert rank["resumed"]["bytes_total"] == rank["whole"]["bytes_total"]
    # and the two replicas really differed at the save (their own state was needed)
    assert not _same(two_ranks[0]["whole"]["params"][1], two_ranks[1]["whole"]["params"][1])


def test_h1_equals_hsdp_on_four_ranks_with_fsdp_or_tp_inside(four_ranks: list[dict[str, Any]]) -> None:
    for rank in four_ranks:
        _assert_close(rank["exact"], rank["hsdp"])
        _assert_close(rank["exact_tp"], rank["sync_tp"])
    # H=2 with tp inside: rank r and r+2 (the same tp shard, the other replica) equal after steps 2 and 4 only
    for a, b in ((four_ranks[0], four_ranks[2]), (four_ranks[1], four_ranks[3])):
        same = [_same(x, y) for x, y in zip(a["h2_tp"]["params"], b["h2_tp"]["params"])]
        assert same == [False, True, False, True], same


def test_pp_inside_each_replica(four_ranks: list[dict[str, Any]]) -> None:
    """pp2 x dp_replicate2: H=1 equals the synchronous run; at H=2 the replicas of each stage (ranks 2p and 2p+1) are
    equal after the outer steps only."""
    for rank in four_ranks:
        assert len(rank["exact_pp"]["params"]) == 4
        _assert_close(rank["exact_pp"], rank["sync_pp"])
    stages = [sorted(four_ranks[p]["exact_pp"]["params"][0]) for p in (0, 2)]
    assert stages == [["net.0.bias", "net.0.weight"], ["net.2.bias", "net.2.weight"]]
    for a, b in ((four_ranks[0], four_ranks[1]), (four_ranks[2], four_ranks[3])):
        same = [_same(x, y) for x, y in zip(a["h2_pp"]["params"], b["h2_pp"]["params"])]
        assert same == [False, True, False, True], same


def test_resume_mid_cycle_in_another_inner_layout(four_ranks: list[dict[str, Any]]) -> None:
    """A dp_replicate2 x tp2 checkpoint of step 2 (an exchange in flight, replicas apart) resumed as pp2 x
    dp_replicate2 (each replica's tp shards of parameters, AdamW state, backup, momentum and the exchange's mean
    resharded into whole tensors of a pipeline stage) continues as the uninterrupted tp2 run does."""
    for pp_rank in range(2):
        for replica in range(2):
            resumed = four_ranks[2 * pp_rank + replica]["resumed_pp"]["params"]
            whole = four_ranks[2 * replica]["whole_tp"]["params"]  # tp ranks 2r, 2r+1: replica r, whole tensors
            assert len(whole) == 6 and len(resumed) == 4  # steps 3..6 after the checkpoint of step 2
            for step, (got, want) in enumerate(zip(resumed, whole[2:]), start=3):
                assert got, step
                for name in got:
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=f"{step} {name}")
    # the replicas really differed at the save (each replica's own state was needed)
    assert not _same(four_ranks[0]["whole_tp"]["params"][1], four_ranks[2]["whole_tp"]["params"][1])


def test_more_replicas_from_a_checkpoint_right_after_an_outer_step(four_ranks: list[dict[str, Any]]) -> None:
    """dp_replicate 2 -> 4 from the H=1 run's checkpoint: every replica starts from replica 0's, and H=1 with outer
    SGD lr 1 goes on as the synchronous dp_replicate4 run resumed from it."""
    for rank in four_ranks:
        assert len(rank["exact_r4"]["params"]) == 1  # 16 samples / (4 x 4) a step: epoch 2 is one step
        _assert_close(rank["exact_r4"], rank["sync_r4"])


def test_telemetry_measures_the_outer_exchange_apart(two_ranks: list[dict[str, Any]]) -> None:
    """Bytes per outer step as issued = the analytic sizes (fp32: 4 B per local element; int8: 1 B + a 4 B scale per
    256, an all-to-all and an all-gather of a chunk per replica); per step they fall by H; the time in outer steps is a
    fraction of the run's."""
    for rank in two_ranks:
        numel = rank["h3"]["numel"]
        runs = {name: rank[name]["telemetry"][-1] for name in ("exact", "h3", "int8", "hsdp")}
        exact, h3, int8 = runs["exact"], runs["h3"], runs["int8"]
        assert exact["diloco/outer_steps"] == 4 and h3["diloco/outer_steps"] == 2 and int8["diloco/outer_steps"] == 2
        assert exact["diloco/bytes_per_outer_step"] == h3["diloco/bytes_per_outer_step"] == 4 * numel
        int8_sizes = [size for _, size in exchange_sizes(numel, "int8", 2)]
        assert int8["diloco/bytes_per_outer_step"] == sum(int8_sizes) == rank["int8"]["bytes_last"]
        assert exact["diloco/bytes_per_step"] == 4 * numel and h3["diloco/bytes_per_step"] == 4 * numel / 3
        assert int8["diloco/bus_bytes_per_step"] == sum(int8_sizes) / 2 / 2  # (n-1)/n of each op's size, / H
        # the exchange is on its own axis; the window of steps 5-6 holds the second outer step of H=3
        assert h3["comm/dp_replicate/bytes"] == 4 * numel / 2 and h3["comm/dp_replicate/calls"] == 1 / 2
        assert exact["comm/dp/bytes"] == h3["comm/dp/bytes"] == runs["hsdp"]["comm/dp/bytes"] - 4 * numel
        assert "comm/dp_replicate/bytes" not in runs["hsdp"] and not any(k.startswith("diloco/") for k in runs["hsdp"])
        for run in (exact, h3, int8):
            assert 0 < run["diloco/outer_fraction"] < 1 and run["diloco/outer_ms"] > 0
