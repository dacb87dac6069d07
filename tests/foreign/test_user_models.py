"""Models written the way users write them, on the cases that used to pass silently (exit 0, a different curve).

One 2-rank launch runs every scenario in turn (sharing its process group); each either trains to the one-process
losses or stops with a message naming the cause and the fix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import GradNorms, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import MeshStrategy, PipelineParallelStrategy, PipelineSpec, TensorParallelStrategy
from lightning_dist.run.launch import launch

WIDTH, STEPS, BATCH = 8, 8, 8


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=BATCH)


class _Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SkipsComputeLoss(_Base):
    """A pipeline-described model whose training_step calls the model itself (not self.compute_loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(OrderedDict((f"b{i}", nn.Linear(WIDTH, WIDTH)) for i in range(4)))

    def compute_loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", loss_fn=F.mse_loss)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss


class BuiltInConfigureModel(_Base):
    """The pipelined model is built in configure_model, as Lightning recommends for large models."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(OrderedDict((f"b{i}", nn.Linear(WIDTH, WIDTH)) for i in range(4)))

    def compute_loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", loss_fn=F.mse_loss)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("loss", loss, sync_dist=True)
        return loss


class LightningExample(_Base):
    """configure_model as Lightning's own tensor-parallel example writes it for ModelParallelStrategy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.w2 = nn.Linear(4 * WIDTH, WIDTH)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:  # one process, no strategy mesh
            return
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if dp_mesh.size() > 1:
            fully_shard(self, mesh=dp_mesh)

    @property
    def device_mesh(self):  # Lightning raises outside ModelParallelStrategy; the example only reads it there
        return self._device_mesh

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.w2(F.gelu(self.w1(batch[0]))), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss


class TiedLM(_Base):
    """An embedding and an output head sharing one weight (GPT-2's default)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            OrderedDict(
                [
                    ("embed", nn.Embedding(16, WIDTH)),
                    ("mix", nn.Linear(WIDTH, WIDTH)),
                    ("head", nn.Linear(WIDTH, 16, bias=False)),
                ]
            )
        )
        self.net.head.weight = self.net.embed.weight

    def compute_loss(self, batch):
        tokens = batch[0]
        return F.cross_entropy(self.net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(
            model_attr="net",
            loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
            split_batch=lambda batch: (batch[0][:, :-1], batch[0][:, 1:]),
        )

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("loss", loss, sync_dist=True)
        return loss


class Conv1D(nn.Module):
    """GPT-2's (transformers) Conv1D: a linear layer with its weight stored (in, out); not an nn.Linear."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class WithConv1D(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * WIDTH, WIDTH)

    def training_step(self, batch, batch_idx):
        return self.c_fc(batch[0]).square().mean()


def _token_loader(batch_size: int = BATCH) -> DataLoader:
    tokens = torch.randint(0, 16, (BATCH * STEPS, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size)


def _fit(module: _Base, strategy: Any, devices: int, loader: DataLoader) -> dict[str, list[float]] | str:
    """The losses and gradient norms of every step, or the error that stopped training."""
    grad_norms = GradNorms()
    trainer = quiet_trainer(strategy, devices, STEPS, callbacks=[grad_norms])
    torch.manual_seed(1)  # what a model built in configure_model draws from
    try:
        trainer.fit(module, loader)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return {"losses": module.losses, "grad_norms": grad_norms.values}


def _one_process() -> dict[str, Any]:
    return {
        "lightning_example": _fit(LightningExample(), "auto", 1, _loader()),
        "tied": _fit(TiedLM(), "auto", 1, _token_loader()),
        "configure_model": _fit(BuiltInConfigureModel(), "auto", 1, _loader()),
    }


def _two_ranks() -> dict[str, Any]:
    tied_plan = {"net.embed": "colwise", "net.head": "colwise"}  # embedding dim vs vocab rows: two layouts
    results = {
        "skips_compute_loss": _fit(SkipsComputeLoss(), PipelineParallelStrategy(pp=2, microbatches=2), 2, _loader()),
        "lightning_example_tp": _fit(LightningExample(), TensorParallelStrategy(tp=2), 2, _loader()),
        "tied_tp": _fit(TiedLM(), TensorParallelStrategy(tp=2, plan=tied_plan), 2, _token_loader()),
        "configure_model_pp": _fit(
            BuiltInConfigureModel(), PipelineParallelStrategy(pp=2, microbatches=2), 2, _loader()
        ),
        "conv1d": _fit(WithConv1D(), TensorParallelStrategy(tp=2, plan={"c_fc": "colwise"}), 2, _loader()),
    }
    pp_module = TiedLM()
    results["tied_pp"] = _fit(pp_module, PipelineParallelStrategy(pp=2, microbatches=2), 2, _token_loader())
    # The pipeline routes the module's compute_loss through the schedule without touching the instance or its class.
    results["pp_instance_untouched"] = "compute_loss" not in vars(pp_module) and type(pp_module) is TiedLM
    module = TiedLM()
    results["tied_fsdp"] = _fit(module, MeshStrategy(dp_shard=2), 2, _token_loader(BATCH // 2))
    results["tied_fsdp_still_tied"] = module.net.head.weight is module.net.embed.weight
    return results


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _one_process()  # in this process: a one-process reference needs no spawned rank


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2)


def assert_same_run(run: dict[str, list[float]] | str, reference: dict[str, list[float]]) -> None:
    """Layout equality: every step's loss (rtol 1e-5) and gradient norm (rtol 1e-4) as in one process."""
    assert isinstance(run, dict), run
    assert len(run["losses"]) == STEPS
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
    np.testing.assert_allclose(run["grad_norms"], reference["grad_norms"], rtol=1e-4)


def test_pipeline_training_step_without_compute_loss_stops(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        message = rank["skips_compute_loss"]  # it calls self.net(...) in training_step: stopped there, named
        assert "SkipsComputeLoss called its model (self(...) or self.net(...)) with gradients enabled" in message
        assert "compute the training loss with self.compute_loss(batch)" in message


def test_lightning_example_configure_model_runs_unchanged(two_ranks, one_process) -> None:
    for rank in two_ranks:
        assert_same_run(rank["lightning_example_tp"], one_process["lightning_example"])


def test_a_tie_tensor_parallelism_cannot_keep_is_an_error(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        assert "net.embed.weight and net.head.weight are one parameter (tied weights)" in rank["tied_tp"]


def test_a_tie_across_pipeline_stages_trains_as_one_parameter(two_ranks, one_process) -> None:
    for rank in two_ranks:  # embedding on stage 0, head on stage 1: gradients summed over the two, norm counted once
        assert_same_run(rank["tied_pp"], one_process["tied"])
        assert rank["pp_instance_untouched"]


def test_a_tie_stays_one_parameter_under_fsdp2(two_ranks, one_process) -> None:
    for rank in two_ranks:
        assert rank["tied_fsdp_still_tied"]
        assert_same_run(rank["tied_fsdp"], one_process["tied"])


def test_a_layer_a_style_cannot_take_is_named(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        assert "tensor-parallel plan: c_fc (Conv1D) cannot take ColwiseParallel" in rank["conv1d"]


def test_a_pipelined_model_built_in_configure_model_starts_from_the_one_process_weights(two_ranks, one_process) -> None:
    for rank in two_ranks:
        assert_same_run(rank["configure_model_pp"], one_process["configure_model"])


class AlwaysEmbeds(nn.Module):
    """Its forward always runs the embedding: on the second stage the embedding is None (a broken stage contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


class ForwardIgnoresStages(_Base):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = AlwaysEmbeds()

    def compute_loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(model_attr="net", blocks_attr="blocks", first=("embed",), loss_fn=F.mse_loss)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("loss", loss)
        return loss


def _broken_stage_forward() -> None:
    quiet_trainer(PipelineParallelStrategy(pp=2, microbatches=2), 2, max_steps=1).fit(ForwardIgnoresStages(), _loader())


def test_a_stage_forward_that_breaks_the_contract_is_named() -> None:
    from lightning_dist.run.launch import RankFailedError

    with pytest.raises(RankFailedError, match=r"forward failed on pipeline stage\(s\) \[\d\]"):
        launch(_broken_stage_forward, 2)
