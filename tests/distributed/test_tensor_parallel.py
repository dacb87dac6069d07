"""TensorParallelStrategy on CPU (gloo): every layout gives the one-process losses and gradient norms."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import FAST, assert_planned, losses, run_app
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist import TensorParallelStrategy
from lightning_dist.run.launch import RankFailedError, launch

STEPS = 20
REFERENCE = ["parallelism=fsdp", "cluster.devices=1"]  # our strategy with every degree 1: plain one-process training
# Validation and the sanity check run too: DTensor and inference_mode do not mix, the strategy must handle it.
WITH_VAL = ["trainer.limit_val_batches=2", "trainer.val_check_interval=10", "trainer.num_sanity_val_steps=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_app([*FAST, *WITH_VAL, *REFERENCE, f"trainer.max_steps={STEPS}"], tmp_path_factory.mktemp("reference"))


def assert_same_run(result: dict, reference: dict) -> None:
    assert len(losses(result)) == STEPS
    np.testing.assert_allclose(losses(result), losses(reference), rtol=1e-5)
    np.testing.assert_allclose(losses(result, "train/grad_norm"), losses(reference, "train/grad_norm"), rtol=1e-4)
    np.testing.assert_allclose(result["val_loss"], reference["val_loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism=tp", "cluster.devices=2"],
        ["parallelism=tp", "cluster.devices=2", "parallelism.tensor.sequence_parallel=false"],
        [
            "parallelism=tp",
            "cluster.devices=2",
            "parallelism.tensor.sequence_parallel=false",
            "parallelism.tensor.loss_parallel=false",
        ],
        ["parallelism=tp_fsdp", "cluster.devices=4"],
        [
            "parallelism=tp_fsdp",
            "cluster.devices=4",
            "parallelism.tensor.sequence_parallel=false",
            "parallelism.tensor.loss_parallel=false",
        ],
        ["parallelism=tp_fsdp", "cluster.devices=4", "parallelism.dp_replicate=2", "parallelism.dp_shard=1"],
    ],
    ids=["tp2", "tp2-nosp", "tp2-nosp-nolp", "tp2xfsdp2", "tp2xfsdp2-nosp-nolp", "tp2xreplicate2"],
)
def test_layout_matches_one_process(layout: list[str], reference: dict, tmp_path: Path) -> None:
    result = run_app([*FAST, *WITH_VAL, *layout, f"trainer.max_steps={STEPS}"], tmp_path)
    assert_same_run(result, reference)
    assert_planned(result)


def test_one_process_reference_is_plain_lightning(reference: dict, tmp_path: Path) -> None:
    """The reference (our strategy, all degrees 1) equals Lightning's own single-process DDP run."""
    plain = run_app([*FAST, *WITH_VAL, "parallelism=ddp", "cluster.devices=1", f"trainer.max_steps={STEPS}"], tmp_path)
    np.testing.assert_allclose(losses(plain), losses(reference), rtol=1e-6)


def test_a_sharded_tp2_checkpoint_resumes_under_fsdp2(tmp_path: Path) -> None:
    layout = [*FAST, "cluster.devices=2", "optim.decay_steps=20", "trainer.enable_checkpointing=true"]
    full = run_app([*layout, "parallelism=tp", "trainer.max_steps=20"], tmp_path / "full")
    first = run_app([*layout, "parallelism=tp", "trainer.max_steps=10"], tmp_path / "first")
    assert Path(first["checkpoint"]).is_dir()  # sharded: torch.distributed.checkpoint files, one set per rank
    resumed = run_app(
        [*layout, "parallelism=fsdp", "trainer.max_steps=20", f"ckpt_path={first['checkpoint']}"], tmp_path / "resumed"
    )
    assert losses(first) == losses(full)[:10]
    assert len(losses(resumed)) == 10
    np.testing.assert_allclose(losses(resumed), losses(full)[10:], rtol=1e-5)


# ---------------------------------------------------------------------------------- a user's own model via plan=
class UserModel(pl.LightningModule):
    """Not the GPT: its own attribute names, trained through ``plan=`` without rewriting it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.trunk = nn.ModuleDict({"expand": nn.Linear(16, 64), "contract": nn.Linear(64, 16)})
        self.classify = nn.Linear(16, 32)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        x = self.embed(tokens)
        x = x + self.trunk["contract"](F.gelu(self.trunk["expand"](x)))
        loss = F.cross_entropy(self.classify(x).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


USER_PLAN = {"trunk.expand": "colwise", "trunk.contract": "rowwise"}


def _fit_user_model(tp: int, plan: dict | None) -> dict:
    from lightning_dist.telemetry import LossHistory

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (64, 9), generator=generator)
    data = torch.utils.data.DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=8)
    history = LossHistory()
    model = UserModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=tp,
        strategy=TensorParallelStrategy(tp=tp, plan=plan, loss_parallel=False),
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
        use_distributed_sampler=False,
    )
    trainer.fit(model, data)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"losses": [r["train/loss"] for r in history.records], "param_bytes": sum(p.nbytes for p in local)}


def test_registered_short_name_builds_our_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers the names)

    assert isinstance(StrategyRegistry.get("tensor_parallel"), TensorParallelStrategy)


def test_user_model_through_plan_matches_one_process() -> None:
    single = launch(_fit_user_model, 1, 1, None)[0]
    sharded = launch(_fit_user_model, 2, 2, USER_PLAN)
    for rank in sharded:
        np.testing.assert_allclose(rank["losses"], single["losses"], rtol=1e-5)
    assert sharded[0]["param_bytes"] < single["param_bytes"]


def test_plan_pattern_matching_nothing_is_an_error() -> None:
    with pytest.raises(RankFailedError, match=r"pattern 'trunk.expnad' matches no module of UserModel"):
        launch(_fit_user_model, 2, 2, {"trunk.expnad": "colwise"})


# --------------------------------------------------------------------------------------------- measured memory
class _StateBytes(pl.Callback):
    """Bytes this rank holds for parameters and optimizer state, measured from the tensors themselves."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def local_bytes(t: torch.Tensor) -> int:
            return (t.to_local() if isinstance(t, DTensor) else t).nbytes

        params = sum(local_bytes(p) for p in pl_module.parameters())
        optim = sum(
            local_bytes(v)
            for state in trainer.optimizers[0].state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        pl_module.state_bytes = params + optim
        out = Path(trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(params + optim, out / f"bytes{trainer.global_rank}.pt")


def test_tp2_halves_parameter_and_optimizer_bytes(tmp_path: Path) -> None:
    from helpers import compose_config

    from lightning_dist.run.fit import fit

    def measure(layout: list[str], out: Path) -> list[int]:
        cfg = compose_config([*FAST, *layout, "trainer.max_steps=2", "model.d_model=128", "model.n_heads=8"], out)
        launch(fit, cfg.cluster.devices, cfg, (_StateBytes(),))
        return [torch.load(out / f"bytes{rank}.pt") for rank in range(cfg.cluster.devices)]

    single = measure(REFERENCE, tmp_path / "single")[0]
    per_rank = measure(["parallelism=tp", "cluster.devices=2"], tmp_path / "tp2")
    assert max(per_rank) <= 0.55 * single, (per_rank, single)
