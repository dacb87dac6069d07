"""Expert parallelism on CPU (gloo): the GPT with MoE blocks trains under ep2, ep2 x FSDP2, ep2 x tp2, pp2 x ep2,
ep2 x cp2 and tp2 exactly as one process does (losses, gradient norms, every gradient and parameter, the routers'
balancing biases, the logged load imbalance, balance loss and z-loss), with activation checkpointing and gradient
accumulation too, and a checkpoint written under one expert-parallel size resumes under another (ep2 -> ep1, ep2 -> ep4,
one process -> ep2). One spawned group of each size (1, 2, 4) runs every case of that size."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy
from lightning_dist.models.gpt import GPTConfig, MoEConfig
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.plan.collectives import per_axis
from lightning_dist.plan.experts import expert_collectives
from lightning_dist.plan.layout import Layout
from lightning_dist.run.launch import launch
from lightning_dist.telemetry import Telemetry

SEQ, BATCH, STEPS = 32, 8, 3
# 4 experts, 2 per token, one shared expert; a balancing rate large enough that the biases change the routing, and
# the sequence-wise balance loss and the z-loss on (weights large enough to change the gradients)
MOE = MoEConfig(num_experts=4, top_k=2, hidden=32, shared_experts=1, balance_rate=0.02, aux_loss_coef=0.1,
                z_loss_coef=0.01)  # fmt: skip
MODEL = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, moe=MOE)
# cp splits a sequence, which the sequence-wise balance loss needs whole (refused): the z-loss and the bias only
MODEL_CP = replace(MODEL, moe=replace(MOE, aux_loss_coef=0.0))
# 2 experts, 1 per token: under ep2 x FSDP2 over 4 ranks each rank holds 1 expert sharded over 2 ranks (FSDP2 shards
# each expert along its rows then, as sharding the single expert's dim 0 would leave one of the 2 ranks nothing)
MODEL_2E = replace(MODEL, moe=replace(MOE, num_experts=2, top_k=1))


class Record(pl.Callback):
    """Each step's logged loss, gradient norm, load imbalance and gradients (whole); after the last step every
    parameter (whole) and every router's balancing bias."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.imbalance: list[dict[str, float]] = []
        self.grads: list[dict[str, np.ndarray]] = []
        self.params: dict[str, np.ndarray] = {}
        self.biases: dict[str, np.ndarray] = {}
        self.start_biases: dict[str, np.ndarray] = {}
        self.all_to_all: list[tuple[int, int]] = []  # the telemetry's ep all-to-all (bytes, calls) so far, per step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # after a resume's load
        self.start_biases = {n: b.numpy().copy() for n, b in pl_module.named_buffers() if n.endswith("expert_bias")}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: _whole(p.grad).detach().numpy().copy() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        if (i + 1) % trainer.accumulate_grad_batches:
            return  # the step goes on: its loss is logged after its last batch
        metrics = trainer.callback_metrics
        self.losses.append(float(metrics["train/loss"]))
        self.norms.append(float(metrics["train/grad_norm"]))
        (telemetry,) = (c for c in trainer.callbacks if isinstance(c, Telemetry))
        ep = telemetry.tracker.stats.get(("ep", "all_to_all")) if telemetry.tracker is not None else None  # 1 rank
        self.all_to_all.append((ep.bytes, ep.count) if ep is not None else (0, 0))
        # per MoE block: imbalance, balance loss and z-loss (a pipeline rank logs its stage's blocks)
        self.imbalance.append({k: float(v) for k, v in metrics.items() if k.startswith("moe/") and k.count("/") > 1})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = {name: _whole(p).detach().numpy().copy() for name, p in pl_module.named_parameters()}
        self.biases = {n: b.numpy().copy() for n, b in pl_module.named_buffers() if n.endswith("expert_bias")}


def _loader(dp: int, accumulate: int = 1) -> DataLoader:
    """The same global batches of ``BATCH`` samples under every layout (a loader's batch is per data-parallel rank and
    accumulated batch)."""
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // dp // accumulate)


def _fit(
    devices: int, steps: int = STEPS, save: str | None = None, ckpt: str | None = None, options: dict | None = None,
    model: GPTConfig = MODEL, accumulate: int = 1, **degrees: int,
) -> dict[str, Any]:  # fmt: skip
    """Train the MoE GPT ``steps`` steps of its ``STEPS``-step schedule under ``degrees``, then validate; ``save``: a
    checkpoint folder written after the last step; ``ckpt``: the checkpoint to resume from; ``accumulate``: batches
    per step (the global batch the same)."""
    torch.set_num_threads(1)
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, every_n_train_steps=steps))
    telemetry = Telemetry(log_every_n_steps=1, print_summary=False)
    callbacks.append(telemetry)
    strategy = MeshStrategy(**degrees, **(options or {}))
    trainer = quiet_trainer(strategy, devices, steps, callbacks, precision="32-true", enable_checkpointing=bool(save),
                            accumulate_grad_batches=accumulate)  # fmt: skip
    dp = ParallelDims(devices, **degrees).dp_size
    module = GPTModule(model, OptimConfig(lr=1e-2, warmup_steps=1), max_steps=STEPS)
    trainer.fit(module, _loader(dp, accumulate), ckpt_path=ckpt)
    held = {
        n: getattr(p, "to_local", lambda p=p: p)().numel()
        for n, p in trainer.lightning_module.named_parameters()
        if ".experts." in n
    }
    val_loss = float(trainer.validate(trainer.lightning_module, _loader(dp), verbose=False)[0]["val/loss"])
    describe = "\n".join(strategy.describe().lines())
    kept = ("losses", "norms", "imbalance", "grads", "params", "biases", "start_biases")
    # Per step: the all-to-alls only (the test's own full_tensor() reads of the experts also gather over ep)
    ep = [
        {"bytes": b - pb, "calls": c - pc} for (b, c), (pb, pc) in zip(record.all_to_all, [(0, 0), *record.all_to_all])
    ]
    return {**{key: getattr(record, key) for key in kept}, "val_loss": val_loss, "describe": describe, "ep": ep,
            "experts_held": held}  # fmt: skip


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _resumed(root: str, devices: int, first: dict[str, int] | None, then: dict[str, int]) -> dict[str, Any]:
    """Train ``STEPS - 1`` steps under ``first`` (``None``: the checkpoint in ``root`` exists), save, and resume under
    ``then`` for the last step (a plain DataLoader resumed mid-epoch reads the first batch again, in every layout)."""
    saved = _fit(devices, steps=STEPS - 1, save=root, **first)["biases"] if first is not None else None
    (ckpt,) = Path(root).glob("*.ckpt")
    return {**_fit(devices, ckpt=str(ckpt), **then), "saved_biases": saved}


def _one_rank(root: str) -> dict[str, Any]:
    return {"fit": _fit(1), "fit-cp": _fit(1, model=MODEL_CP), "fit-2e": _fit(1, model=MODEL_2E),
            "resumed": _resumed(root, 1, {}, {})}  # fmt: skip


def _two_ranks(root: str, one_process_ckpt: str) -> dict[str, Any]:
    out = {"ep2": _fit(2, dp_shard=2, ep=2), "tp2": _fit(2, tp=2, dp_shard=1)}
    out["ep2-ac"] = _fit(2, dp_shard=2, ep=2, options={"activation_checkpointing": {"mode": "full"}})
    out["ep2-acc2"] = _fit(2, dp_shard=2, ep=2, accumulate=2)
    out["ep2->ep1"] = _resumed(root, 2, {"dp_shard": 2, "ep": 2}, {"dp_shard": 2})
    out["1->ep2"] = _resumed(one_process_ckpt, 2, None, {"dp_shard": 2, "ep": 2})
    return out


def _four_ranks(root: str) -> dict[str, Any]:
    out = {"ep2xfsdp2": _fit(4, dp_shard=4, ep=2), "ep2xtp2": _fit(4, dp_shard=2, ep=2, tp=2)}
    out["pp2xep2"] = _fit(4, pp=2, dp_shard=2, ep=2)
    out["ep2xcp2"] = _fit(4, dp_shard=2, ep=2, cp=2, model=MODEL_CP)
    out["ep2->ep4"] = _resumed(root, 4, {"dp_shard": 4, "ep": 2}, {"dp_shard": 4, "ep": 4})
    out["ep2xfsdp2-2e"] = _fit(4, dp_shard=4, ep=2, model=MODEL_2E)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one")
    return {**launch(_one_rank, 1, str(root))[0], "root": str(root)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, one_rank: dict[str, Any]) -> list[dict[str, Any]]:
    return launch(_two_ranks, 2, str(tmp_path_factory.mktemp("ep2")), one_rank["root"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_four_ranks, 4, str(tmp_path_factory.mktemp("ep4")))


def _assert_same_run(run: dict[str, Any], reference: dict[str, Any], steps: int = STEPS) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == steps
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
    np.testing.assert_allclose(run["norms"], reference["norms"], rtol=1e-5)
    for got, want in zip(run["imbalance"], reference["imbalance"], strict=True):  # the routing statistics
        assert got.keys() <= want.keys() and got
        np.testing.assert_allclose([got[k] for k in got], [want[k] for k in got], rtol=1e-6)
    for step, (got, want) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        assert got.keys() <= want.keys() and got  # under pp: this rank's stage's parameters
        for name in got:
            # atol at the tensor's scale: tp's sums in another order leave ~1e-7 on its near-zero elements
            atol = max(1e-7, 1e-5 * float(np.abs(want[name]).max()))
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=atol, err_msg=f"step {step} {name}")
    for name, got in run["params"].items():
        np.testing.assert_allclose(got, reference["params"][name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert run["biases"].keys() <= reference["biases"].keys() and run["biases"]
    for name, got in run["biases"].items():  # the balancing: equal counts over the global batch, equal steps
        np.testing.assert_allclose(got, reference["biases"][name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(run["val_loss"], reference["val_loss"], rtol=1e-5)


def test_the_reference_balances_its_experts(one_rank: dict) -> None:
    """The one-process run the layouts are compared with routes unevenly and moves its biases (the comparison of the
    biases and imbalance below is not of zeros)."""
    run = one_rank["fit"]
    assert all(v > 1.0 for step in run["imbalance"] for k, v in step.items() if k.startswith("moe/imbalance/"))
    assert all(np.abs(bias).max() > 0 for bias in run["biases"].values())
    losses = {k.split("/")[1] for k, v in run["imbalance"][0].items() if v > 0}
    assert losses == {"imbalance", "aux_loss", "z_loss"}  # the balance and z losses are on and compared too
    assert not any(k.startswith("moe/aux_loss/") for k in one_rank["fit-cp"]["imbalance"][0])
    assert one_rank["fit-cp"]["losses"][-1] != run["losses"][-1]  # the balance loss changes the training


@pytest.mark.parametrize("layout", ["ep2", "ep2-ac", "ep2-acc2", "tp2"])
def test_two_rank_layouts_match_one_process(layout: str, two_ranks: list, one_rank: dict) -> None:
    for rank in two_ranks:
        _assert_same_run(rank[layout], one_rank["fit"])
    if layout.startswith("ep2"):
        assert "experts split over ep=2 (2 per rank), all-to-all dispatch" in two_ranks[0][layout]["describe"]
        # each rank holds its half of every expert tensor (Shard(0) over ep): the halves differ
        assert "model.layers.*.moe.experts" in two_ranks[0][layout]["describe"]


@pytest.mark.parametrize("layout", ["ep2xfsdp2", "ep2xtp2", "pp2xep2", "ep2xcp2"])
def test_four_rank_layouts_match_one_process(layout: str, four_ranks: list, one_rank: dict) -> None:
    for rank in four_ranks:
        _assert_same_run(rank[layout], one_rank["fit-cp" if layout == "ep2xcp2" else "fit"])
    held = set().union(*(rank[layout]["params"] for rank in four_ranks))
    assert held == one_rank["fit"]["params"].keys()  # every parameter checked on some rank (pp: each stage's own)


def test_experts_fewer_than_their_fsdp_ranks_are_sharded_along_their_rows(four_ranks: list, one_rank: dict) -> None:
    for rank in four_ranks:
        _assert_same_run(rank["ep2xfsdp2-2e"], one_rank["fit-2e"])
    held = [rank["ep2xfsdp2-2e"]["experts_held"] for rank in four_ranks]
    # every rank half of its one expert's rows: (1, 32, 32) gate / up, (1, 32, 32) down, halves of 1024 each
    assert all(set(rank.values()) == {512} for rank in held), held


@pytest.mark.parametrize("resumed", ["ep2->ep1", "1->ep2"])
def test_a_checkpoint_reshards_across_expert_parallel_sizes(resumed: str, two_ranks: list, one_rank: dict) -> None:
    assert one_rank["resumed"]["losses"][0] != one_rank["fit"]["losses"][0]  # the same batch, trained weights
    saved = one_rank["resumed"]["saved_biases"]  # the routers' balancing biases are in the checkpoint
    assert saved and any(np.abs(bias).max() > 0 for bias in saved.values())
    for rank in two_ranks:
        _assert_same_run(rank[resumed], one_rank["resumed"], steps=1)
        for name, bias in rank[resumed]["start_biases"].items():
            np.testing.assert_array_equal(bias, (rank[resumed]["saved_biases"] or saved)[name], err_msg=name)


def test_an_ep2_checkpoint_resumes_under_ep4(four_ranks: list, one_rank: dict) -> None:
    for rank in four_ranks:
        _assert_same_run(rank["ep2->ep4"], one_rank["resumed"], steps=1)
        for name, bias in rank["ep2->ep4"]["start_biases"].items():  # the balancing biases resumed as saved
            np.testing.assert_array_equal(bias, rank["ep2->ep4"]["saved_biases"][name], err_msg=name)
    assert "experts split over ep=4 (1 per rank)" in four_ranks[0]["ep2->ep4"]["describe"]


@pytest.mark.parametrize(
    ("layout", "ranks", "degrees", "options"),
    [("ep2", 2, {"dp_shard": 2, "ep": 2}, {}),
     ("ep2-ac", 2, {"dp_shard": 2, "ep": 2}, {"activation_checkpointing": {"mode": "full"}}),
     ("ep2xfsdp2", 4, {"dp_shard": 4, "ep": 2}, {}),
     ("ep2xtp2", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, {}),
     ("pp2xep2", 4, {"pp": 2, "dp_shard": 2, "ep": 2}, {})],
)  # fmt: skip
def test_the_ep_all_to_all_bytes_are_the_planned_ones(layout, ranks, degrees, options, two_ranks, four_ranks) -> None:
    """The telemetry's all-to-all bytes and calls on ``ep`` of every step, averaged over an ep group's ranks (a rank's
    own count follows the routing), are the planner's: the counts, the rows both ways, their gradients, a recomputed
    forward's. A pipeline's first step also runs torch's shape inference through its stage (compared from step 2)."""
    runs, dims = (two_ranks if ranks == 2 else four_ranks), ParallelDims(ranks, **degrees)
    options = Parallelism().with_fields(**options)
    micro_batch = BATCH // dims.dp_size // (options.pipeline.num_microbatches(dims.pp) if dims.pp > 1 else 1)
    for rank in range(ranks):
        coords = dims.coordinates(rank)
        group = [r for r in range(ranks) if {k: v for k, v in dims.coordinates(r).items() if k != "dp_shard"} ==
                 {k: v for k, v in coords.items() if k != "dp_shard"} and dims.coordinates(r)["dp_shard"] // dims.ep
                 == coords["dp_shard"] // dims.ep]  # fmt: skip
        lay = Layout(dims, options, micro_batch=micro_batch)
        planned = per_axis(expert_collectives(MODEL, lay, SEQ, "32-true", coords["pp"]))["ep"]
        assert planned["bytes"] > 0 and len(group) == dims.ep
        for step in range(1 if dims.pp > 1 else 0, STEPS):
            for kind in ("bytes", "calls"):
                measured = np.mean([runs[r][layout]["ep"][step][kind] for r in group])
                assert measured == planned[kind], f"rank {rank} step {step} {kind}: {measured} != {planned[kind]}"
