"""Context parallelism on CPU (gloo): the all-gather attention equals causal attention over the whole sequence, and
cp2, cp2 x tp2, cp2 x FSDP2 and pp2 x cp2 train the GPT exactly as one process does (DiLoCo replicas with cp2
inside as DiLoCo without). One spawned group of each size (1, 2, 4) runs every case of that size."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy
from lightning_dist.models.gpt import GPTConfig, causal_attention
from lightning_dist.models.module import GPTModule
from lightning_dist.models.optim import OptimConfig
from lightning_dist.parallel.context import (
    AllGatherAttention,
    shard_sequence,
    undo_context_parallel,
    unshard_sequence,
)
from lightning_dist.parallel.context_attention import TorchRingAttention
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.run.launch import launch

SEQ, BATCH, STEPS = 256, 4, 3  # the sequence length
DILOCO = {"sync": "diloco", "every": 2}  # replicas apart for a step, then the outer step (Nesterov)
MODEL = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=256)


class Record(pl.Callback):
    """Each step's logged loss, gradient norm and gradients (whole), and every parameter (whole) after the last step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.grads: list[dict[str, np.ndarray]] = []
        self.params: dict[str, np.ndarray] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: _whole(p.grad).detach().numpy().copy() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, p in pl_module.named_parameters():
            self.params[name] = _whole(p).detach().numpy().copy()


def _loader(dp: int) -> DataLoader:
    """The same global batches of ``BATCH`` samples under every layout: a loader's batch size is per data-parallel
    rank (lightning_dist deals each global batch out)."""
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // dp)


def _fit(
    devices: int,
    steps: int = STEPS,
    save: str | None = None,
    ckpt: str | None = None,
    options: dict | None = None,
    **degrees: int,
) -> dict:
    """Train the GPT ``steps`` steps of its ``STEPS``-step schedule under ``degrees`` (and strategy ``options``), then
    validate; ``save``: a checkpoint folder written after the last step; ``ckpt``: the checkpoint to resume from."""
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, every_n_train_steps=steps))
    strategy = MeshStrategy(**degrees, **(options or {}))
    optim = OptimConfig(lr=1e-3, warmup_steps=1)
    trainer = quiet_trainer(strategy, devices, steps, callbacks, precision="32-true", enable_checkpointing=bool(save))
    dp = ParallelDims(devices, **degrees).dp_size
    trainer.fit(GPTModule(MODEL, optim, max_steps=STEPS), _loader(dp), ckpt_path=ckpt)
    val_loss = float(trainer.validate(trainer.lightning_module, _loader(dp), verbose=False)[0]["val/loss"])
    describe = "\n".join(strategy.describe().lines())
    out = {"losses": record.losses, "norms": record.norms, "grads": record.grads, "params": record.params}
    out |= {"describe": describe, "val_loss": val_loss}
    if dp == 1:  # data parallelism deals the samples out: each rank would predict its own
        predicted = trainer.predict(
            trainer.lightning_module, DataLoader(_loader(1).dataset.tensors[0][:2], batch_size=2)
        )
        out["predicted"] = _whole(predicted[0]).numpy()
    modules = [trainer.lightning_module, *getattr(strategy.pipeline, "views", ())]  # under pp, the stages' views too
    out["cp_left"] = sum(len(undo_context_parallel(module)) for module in modules)  # after teardown: none left
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _attention(heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """The cp attention of this rank's head-tail part, its gradients, and the whole-sequence reference (every rank
    computes the reference from the same seeded tensors)."""
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, SEQ, 8, generator=generator, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(2, heads, SEQ, 8, generator=generator, dtype=torch.float64)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    causal_attention(*whole).backward(grad)
    local = [shard_sequence(t, cp, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = AllGatherAttention(group)(*local)
    out.backward(shard_sequence(grad, cp, rank, dim=2))
    parts = {"out": out, **{f"d{n}": t.grad for n, t in zip("qkv", local)}}
    gathered = {}
    for key, part in parts.items():  # back to the whole sequence, to compare with the reference
        pieces = [torch.empty_like(part) for _ in range(cp)]
        dist.all_gather(pieces, part.detach().contiguous())
        gathered[key] = unshard_sequence(pieces, dim=2).numpy()
    reference = {"out": causal_attention(*whole).detach().numpy()}
    reference |= {f"d{n}": t.grad.numpy() for n, t in zip("qkv", whole)}
    return {"got": gathered, "want": reference}


class _StandInRing(TorchRingAttention):
    """torch's ring stood in for on CPU (it has CUDA kernels only): the exact attention's output plus ``error``."""

    def __init__(self, error: float, fallback: bool) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
        super().__init__(mesh, fallback=AllGatherAttention(mesh.get_group()) if fallback else None)
        self.error, self.ring_calls = error, 0

    def _kernel_support(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return False  # a ring kernel takes these inputs as they are

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, repeat: bool) -> Any:
        self.ring_calls += 1
        return self.reference(q, k, v, scale=scale) + self.error


def _ring_checked() -> dict[str, Any]:
    """A ring that agrees with the exact attention is used (checked once per input kind); one that disagrees is not:
    ``auto`` warns and runs the all-gather attention, ``torch`` stops."""
    q, k, v = (torch.randn(1, n, SEQ // 2, 8, generator=torch.Generator().manual_seed(n)) for n in (4, 2, 2))
    out: dict[str, Any] = {}
    for name, error in (("agrees", 0.0), ("differs", 1.0)):
        ring = _StandInRing(error, fallback=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gaps = [float((ring(q, k, v) - ring.reference(q, k, v)).abs().max()) for _ in range(2)]
        out[name] = {"gaps": gaps, "ring_calls": ring.ring_calls, "warnings": [str(w.message) for w in caught]}
    try:
        _StandInRing(1.0, fallback=False)(q, k, v)
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    return out


def _resumed(root: str, first: dict[str, int], then: dict[str, int]) -> dict[str, Any]:
    """Train ``STEPS - 1`` steps under ``first``, save, and resume under ``then`` for the last step. (A plain DataLoader
    resumed mid-epoch starts the epoch again in Lightning: the last step reads the first batch, in every layout.)"""
    devices = int(np.prod(list(first.values())))
    _fit(devices, steps=STEPS - 1, save=root, dp_shard=1, **first)
    (ckpt,) = Path(root).glob("*.ckpt")
    return _fit(devices, ckpt=str(ckpt), dp_shard=1, **then)


def _one_rank(root: str) -> dict[str, Any]:
    return {"fit": _fit(1), "resumed": _resumed(root, {}, {})}


def _two_ranks(root: str) -> dict[str, Any]:
    cp2 = _fit(2, cp=2, dp_shard=1)  # first: the Trainer starts the process group, which the attention cases use
    out = {"cp2": cp2, "attention": {"gqa": _attention(4, 2), "mha": _attention(4, 4)}}
    out["cp2-ac"] = _fit(2, cp=2, dp_shard=1, options={"activation_checkpointing": {"mode": "full"}})
    out["resumed_tp2"] = _resumed(root, {"cp": 2}, {"tp": 2})
    out["resumed_cp2"] = _resumed(str(Path(root) / "from_tp2"), {"tp": 2}, {"cp": 2})
    out["diloco"] = _fit(2, dp_replicate=2, dp_shard=1, options=DILOCO)
    out["ring_checked"] = _ring_checked()
    return out


def _four_ranks() -> dict[str, Any]:
    out = {"cp2xtp2": _fit(4, cp=2, tp=2, dp_shard=1), "cp2xfsdp2": _fit(4, cp=2, dp_shard=2)}
    out["pp2xcp2"] = _fit(4, pp=2, cp=2, dp_shard=1)  # each stage's blocks attend across the cp ranks of its stage
    out["diloco_cp2"] = _fit(4, dp_replicate=2, cp=2, dp_shard=1, options=DILOCO)
    return {**out, "attention": _attention(4, 1)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch(_one_rank, 1, str(tmp_path_factory.mktemp("one")))[0]


@pytest.fixture(scope="module")
def reference(one_rank: dict[str, Any]) -> dict[str, Any]:
    return one_rank["fit"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_two_ranks, 2, str(tmp_path_factory.mktemp("cp2")))


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return launch(_four_ranks, 4)


def _assert_attention_exact(result: dict[str, Any]) -> None:
    for key, want in result["want"].items():
        np.testing.assert_allclose(result["got"][key], want, rtol=1e-10, atol=1e-12, err_msg=key)


def _assert_same_run(run: dict[str, Any], reference: dict[str, Any], steps: int = STEPS) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == steps
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
    np.testing.assert_allclose(run["norms"], reference["norms"], rtol=1e-5)
    for step, (got, want) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        assert got.keys() <= want.keys() and got  # under pp: this rank's stage's parameters
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=f"step {step} {name}")
    # AdamW turns a near-zero gradient's rounding into up to a fraction of a step (lr=1e-3): a looser atol
    for name, got in run["params"].items():
        np.testing.assert_allclose(got, reference["params"][name], rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(run["val_loss"], reference["val_loss"], rtol=1e-5)
    if "predicted" in run:  # gathered back to the whole sequence (B, T, V) from each cp rank's part
        np.testing.assert_allclose(run["predicted"], reference["predicted"], rtol=1e-5, atol=1e-6)


def test_allgather_attention_equals_causal_attention(two_ranks: list, four_ranks: list) -> None:
    for rank in two_ranks:
        _assert_attention_exact(rank["attention"]["gqa"])
        _assert_attention_exact(rank["attention"]["mha"])
    for rank in four_ranks:  # cp=4, 4 query heads on 1 key/value head
        _assert_attention_exact(rank["attention"])


def test_cp2_matches_one_process(two_ranks: list, reference: dict) -> None:
    for rank in two_ranks:
        _assert_same_run(rank["cp2"], reference)
        _assert_same_run(rank["cp2-ac"], reference)  # the recomputed forward all-gathers again
    assert (
        "context parallel cp=2: head-tail sequence split; 2 attention modules: all-gather"
        in (two_ranks[0]["cp2"]["describe"])
    )


@pytest.mark.parametrize("resumed", ["resumed_tp2", "resumed_cp2"])
def test_a_checkpoint_reshards_between_cp2_and_tp2(resumed: str, two_ranks: list, one_rank: dict) -> None:
    """cp2 -> tp2 and tp2 -> cp2: the resumed step equals one process's."""
    assert one_rank["resumed"]["losses"][0] != one_rank["fit"]["losses"][0]  # the same batch, trained weights
    for rank in two_ranks:
        _assert_same_run(rank[resumed], one_rank["resumed"], steps=1)


@pytest.mark.parametrize("layout", ["cp2xtp2", "cp2xfsdp2", "pp2xcp2"])
def test_cp2_with_tp_fsdp_or_pp_matches_one_process(layout: str, four_ranks: list, reference: dict) -> None:
    for rank in four_ranks:
        _assert_same_run(rank[layout], reference)
        assert rank[layout]["cp_left"] == 0  # teardown undid every cp change (under pp: the stage views' too)
    held = set().union(*(rank[layout]["params"] for rank in four_ranks))
    assert held == reference["params"].keys()  # every parameter checked on some rank (pp: each stage's own)


def test_diloco_replicas_split_their_sequences_over_cp(two_ranks: list, four_ranks: list) -> None:
    """DiLoCo over 2 replicas with cp2 inside each equals DiLoCo over 2 replicas without cp (H=2, AdamW inside)."""
    for rank, run in enumerate(four_ranks):  # ranks 0, 1: replica 0's cp ranks; 2, 3: replica 1's
        got, want = run["diloco_cp2"], two_ranks[rank // 2]["diloco"]
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
        for name, param in want["params"].items():
            np.testing.assert_allclose(got["params"][name], param, rtol=1e-5, atol=1e-6, err_msg=name)
    # the last of the 3 steps is an inner one: the replicas end apart
    assert not np.allclose(
        two_ranks[0]["diloco"]["params"]["model.head.weight"], two_ranks[1]["diloco"]["params"]["model.head.weight"]
    )


def test_torchs_ring_is_used_only_where_it_agrees_with_the_exact_attention(two_ranks: list) -> None:
    for rank in two_ranks:
        agrees, differs = rank["ring_checked"]["agrees"], rank["ring_checked"]["differs"]
        assert agrees["gaps"] == [0.0, 0.0] and agrees["ring_calls"] == 3 and not agrees["warnings"]  # 1 check + 2
        assert differs["gaps"] == [0.0, 0.0] and differs["ring_calls"] == 1  # checked once, then all-gather
        assert len(differs["warnings"]) == 1 and "differs from the exact attention by" in differs["warnings"][0]
        assert rank["ring_checked"]["refused"].startswith("context.attention=torch: torch's ring attention differs")


def test_head_tail_round_trip_and_balance() -> None:
    x = torch.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3, 4):
        parts = [shard_sequence(x, cp, rank) for rank in range(cp)]
        assert torch.equal(unshard_sequence(parts), x)
        # causal work per rank: the sum over its positions of (position + 1) is the same on every rank
        work = {int((part[0] + 1).sum()) for part in parts}
        assert len(work) == 1
    assert shard_sequence(x, 2, 0)[0].tolist() == [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]


def test_cp_mesh_and_rules() -> None:
    dims = ParallelDims(world_size=4, cp=2, tp=2)
    assert dims.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}
    assert dims.dp_size == 1 and dims.dp_cp_size == 2 and dims.fsdp_mesh_axes == ("dp_shard_cp",)
    assert [dims.coordinates(r)["cp"] for r in range(4)] == [0, 0, 1, 1]
    assert {dims.dp_rank(r) for r in range(4)} == {0}  # the cp ranks read the same batch
    assert dims.describe() == "pp=1 dp_replicate=1 dp_shard=1 cp=2 tp=2 (world 4)"
    assert ParallelDims(world_size=8, cp=2, dp_replicate=2).fsdp_mesh_axes == ("dp_replicate", "dp_shard_cp")
    with pytest.raises(ValueError, match=r"^data.seq_len=60 is not divisible by 2 x cp = 8 .* use data.seq_len=56"):
        ParallelDims(world_size=4, cp=4).check_seq_len(60)
    ParallelDims(world_size=4, cp=4).check_seq_len(64)
    assert ParallelDims(world_size=4, cp=2, pp=2).fsdp_mesh_axes == ("dp_shard_cp",)  # a stage's cp ranks shard it
