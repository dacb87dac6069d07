"""Compressed synchronous gradients: DDP's communication hooks (``ddp.comm_hook``) and FSDP2's ``fsdp.reduce_dtype``.

Measured by the telemetry on 2 gloo ranks: bf16 halves the bytes of the gradient reduction and leaves the others
alone; the run still trains to nearly the same loss (the sums are rounded, so not exactly).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dist import MeshStrategy
from lightning_dist.parallel.options import DDPOptions, Parallelism
from lightning_dist.run.launch import launch
from lightning_dist.strategies.data_parallel import DataParallelStrategy
from lightning_dist.telemetry import Telemetry

VOCAB, D, SEQ, LOCAL_BATCH, STEPS = 512, 256, 8, 4, 4  # ~1 MiB of gradients: the table's MiB resolve it


class _TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.head(self.emb(inputs)).flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(strategy: pl.strategies.Strategy) -> dict[str, Any]:
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * 2 * STEPS, SEQ + 1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=LOCAL_BATCH
    )
    module, telemetry = _TinyLM(), Telemetry(log_every_n_steps=STEPS, print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, callbacks=[telemetry],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, data)
    columns, rows = telemetry.tables["comm"]
    comm = {(row[0], row[1]): dict(zip(columns, row))["MiB"] for row in rows}
    return {"comm": comm, "losses": module.losses}


def _rank(_: Any) -> dict[str, Any]:
    # fp16: torch's DDP refuses its bf16 hook without CUDA + NCCL (the strategy says so before it starts).
    def ddp_with(hook: str | None) -> DataParallelStrategy:
        return DataParallelStrategy(parallelism=Parallelism().with_fields(comm_hook=hook))

    ddp = {hook: _fit(ddp_with(hook)) for hook in (None, "fp16")}
    ddp["powersgd"] = _fit(ddp_with("powersgd"))
    fsdp = {dtype: _fit(MeshStrategy(dp_shard=2, reduce_dtype=dtype)) for dtype in (None, "bf16")}
    return {"ddp": ddp, "fsdp": fsdp}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_rank, 2, None)


def test_an_fp16_ddp_hook_halves_the_all_reduce_bytes(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        full, bf16 = rank["ddp"][None], rank["ddp"]["fp16"]
        assert bf16["comm"][("dp", "all_reduce")] * 2 == pytest.approx(full["comm"][("dp", "all_reduce")], rel=0.01)
        assert bf16["losses"] == pytest.approx(full["losses"], rel=1e-2)
        assert bf16["losses"] != full["losses"]  # rounded sums: close, not equal
        # PowerSGD starts with torch's plain all-reduce warm-up: the full bytes, the same curve.
        assert rank["ddp"]["powersgd"]["losses"] == pytest.approx(full["losses"], rel=1e-5)


def test_fsdp_reduce_dtype_bf16_halves_the_reduce_scatter_only(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        full, bf16 = rank["fsdp"][None]["comm"], rank["fsdp"]["bf16"]["comm"]
        assert bf16[("dp", "reduce_scatter")] * 2 == pytest.approx(full[("dp", "reduce_scatter")], rel=0.01)
        assert bf16[("dp", "all_gather")] == full[("dp", "all_gather")]
        assert rank["fsdp"]["bf16"]["losses"] == pytest.approx(rank["fsdp"][None]["losses"], rel=1e-2)


def test_each_strategy_refuses_the_others_compression() -> None:
    with pytest.raises(ValueError, match=r"^parallelism.ddp.comm_hook='bf16' is Lightning DDP's; FSDP2 .*reduce_dtype"):
        MeshStrategy(comm_hook="bf16")
    with pytest.raises(ValueError, match=r"^parallelism.fsdp.reduce_dtype='bf16' is FSDP2's; Lightning's DDP .*bf16"):
        DataParallelStrategy(parallelism=Parallelism().with_fields(reduce_dtype="bf16"))
    with pytest.raises(
        ValueError, match=r"^parallelism.ddp.comm_hook='int4' is unknown; use bf16, fp16, powersgd, null"
    ):
        DDPOptions(comm_hook="int4")
