"""The LightningModule that trains the reference GPT. No distributed code: strategies parallelize it from outside.

It implements every hook of :class:`lightning_dist.contract.ParallelModule`, the contract a user's own module can
follow too.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.metric import CompositionalMetric

from lightning_dist import _compat
from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.models.gpt_parallel import (
    check_context_parallel,
    check_tensor_parallel,
    gpt_context_parallel_spec,
    gpt_expert_parallel_spec,
    gpt_tensor_parallel_plan,
)
from lightning_dist.models.lora import apply_lora, init_lora, to_keeping_adapters
from lightning_dist.models.loss import chunked_token_loss, split_token_batch, token_loss
from lightning_dist.models.moe import load_stats, moe_layers, update_expert_bias
from lightning_dist.models.optim import OptimConfig, adamw_with_schedule
from lightning_dist.models.qlora import NF4_NAMES, base_linears, nf4_names, quantize_base
from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.expert import ExpertParallelSpec
from lightning_dist.parallel.pipeline import PipelineSpec


class GPTModule(pl.LightningModule):
    """Trains :class:`GPT` on (inputs, targets) token batches.

    Args:
        model: Architecture of the GPT.
        optim: AdamW + warmup/cosine schedule settings.
        max_steps: Length of the cosine schedule (the trainer's ``max_steps``).
        init_seed: Seed of the per-parameter initialization (the same on every layout).
        hf_source: The HuggingFace folder the run starts from (``init_from``), kept in the checkpoint so
            ``lightning-dist-export`` copies its tokenizer and generation config next to the exported weights.
    """

    def __init__(
        self, model: GPTConfig, optim: OptimConfig, max_steps: int, init_seed: int = 0, hf_source: str | None = None
    ) -> None:
        super().__init__()
        self.model_config = model
        self.optim_config = optim
        self.max_steps = max_steps
        self.init_seed = init_seed
        hparams = {"model": asdict(model), "optim": asdict(optim), "max_steps": max_steps}
        self.save_hyperparameters({**hparams, "hf_source": hf_source} if hf_source else hparams)
        self.model: GPT | None = None
        self.loss_chunks = 0  # the head and loss in this many pieces of the tokens (set_loss_chunks); 0 = whole
        self.val_loss = MeanMetric()
        self.val_ppl = CompositionalMetric(torch.exp, self.val_loss, None)  # exp of val_loss's (cached) result
        self.step_loss = StepLoss()

    # ------------------------------------------------------------------------------------------------- model
    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.to``, but LoRA adapters stay float32 when the module is converted to bf16 (``bf16-true``)."""
        return to_keeping_adapters(super().to, self, *args, **kwargs)

    def configure_model(self) -> None:
        """Build the model (on the meta device when the strategy asks for empty init; it materializes later)."""
        if self.model is not None:
            return
        self.model = GPT(self.model_config)
        if self.model_config.lora.enabled:  # adapters on the frozen model (models/lora.py)
            apply_lora(self.model, self.model_config.lora, blocks="layers")
        if not next(self.model.parameters()).is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialize after a strategy materialized the model from the meta device."""
        self.model.init_weights(self.init_seed)
        init_lora(self.model, self.init_seed)

    def on_fit_start(self) -> None:
        """QLoRA (``model.lora.quantize``): the frozen base stored in 4 bits once its weights are in place (read from
        ``init_from``, the precision applied) and before a checkpoint being continued is read into it."""
        if self.model_config.lora.enabled and self.model_config.lora.quantize is not None:
            quantize_base(self.model, "layers", self.model_config.lora.quantize)

    def unsharded_parameters(self) -> list[nn.Parameter]:
        """QLoRA: the frozen base FSDP2 leaves whole on every rank, each weight quantized from its whole loaded value
        (as one process quantizes it); the adapters, embedding, norms and head are sharded as usual."""
        if not (self.model_config.lora.enabled and self.model_config.lora.quantize is not None):
            return []
        return [layer.weight for layer in base_linears(self.model, "layers").values()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A QLoRA checkpoint names its NF4 tensors (saved as they are: a resumed run continues on the same base)."""
        if names := nf4_names(self):
            checkpoint[NF4_NAMES] = names

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor, scale: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy in float32 over the targets that are not -100 (data=hf's prompt tokens);
        with ``scale`` (masked data) ``sum * scale / B``, the micro batch's share of the global batch's token mean
        (``lightning_dist/models/loss.py``). ``logits`` (B, T, V), ``targets`` (B, T)."""
        return token_loss(logits, targets, scale)

    def compute_loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        """The loss of ``(inputs, targets)`` or of a masked ``(inputs, targets, norm)`` batch."""
        inputs, targets, *loss_kwargs = split_token_batch(batch)
        kwargs = loss_kwargs[0] if loss_kwargs else {}
        if self.loss_chunks:
            return self.chunked_loss(self.model(inputs, logits=False), targets, **kwargs)
        return self.loss_fn(self.model(inputs), targets, **kwargs)

    def set_loss_chunks(self, chunks: int) -> None:
        """Compute the head and the loss in ``chunks`` pieces of the tokens, each recomputed in the backward, so the
        ``(B, T, V)`` logits are never held whole (``0``: the plain loss). The same loss up to fp32 rounding."""
        if chunks < 0:
            raise ValueError(f"loss_chunks={chunks} must be >= 0 (0 = the whole logits at once).")
        self.loss_chunks = chunks

    def chunked_loss(self, hidden: Tensor, targets: Tensor, scale: Tensor | None = None) -> Tensor:
        """:meth:`loss_fn` from the final hidden states ``(B, T, C)``, the head applied piece by piece
        (``lightning_dist/models/loss.py: chunked_token_loss``)."""
        return chunked_token_loss(hidden, self.model.head, targets, self.loss_chunks, scale)

    # -------------------------------------------------------------------------------------------- lightning
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        step_loss = self.step_loss.update(loss, self.trainer)
        # Logged on logging steps only: sync_dist is a collective whose result Lightning reads, and a float becomes
        # a device tensor (a host-to-device copy); the loggers receive the same values as when logged every step.
        # No prog_bar: Lightning would read it back after every batch (callbacks/progress.py shows it instead).
        if step_loss is not None and _compat.logs_this_step(self.trainer):
            # sync_dist: the logged value is the global-batch loss whatever the layout.
            self.log("train/loss", step_loss, sync_dist=True)
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self.compute_loss(batch).detach()
        if hasattr(loss, "full_tensor"):  # a replicated DTensor under loss parallelism; metrics add plain tensors
            loss = loss.full_tensor()
        self.val_loss.update(loss, weight=batch[0].shape[0])

    def on_validation_epoch_end(self) -> None:
        # The metric objects, not their values: Lightning computes them once the epoch ends (torchmetrics syncs over
        # the data-parallel ranks) and resets them, and knows they need no sync_dist (a tensor would be synced again,
        # or warned about).
        self.log("val/loss", self.val_loss)
        self.log("val/ppl", self.val_ppl)

    # ------------------------------------------------------------------------------- parallelism contract
    def tensor_parallel_plan(self, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, Any]:
        """The GPT's tensor-parallel plan, by module name relative to this module."""
        return gpt_tensor_parallel_plan("model.", sequence_parallel, loss_parallel, self.model_config)

    def pipeline_spec(self) -> PipelineSpec:
        """How a pipeline splits the GPT: ``model.layers`` are the blocks, embeddings first, norm and head last."""
        chunked = self.loss_chunks > 0  # the last stage returns hidden states; the loss applies the head in pieces
        return PipelineSpec(
            model_attr="model",
            blocks_attr="layers",
            first=("tok_emb", "pos_emb"),
            last=("norm", "head"),
            loss_fn=self.chunked_loss if chunked else self.loss_fn,
            split_batch=split_token_batch,
            stage_forward=_hidden_states_forward if chunked else None,
            head="head" if chunked else None,
        )

    def check_tensor_parallel(self, tp: int, sequence_parallel: bool = True) -> None:
        """Raise before sharding when ``tp`` cannot split this model."""
        check_tensor_parallel(self.model_config, tp, None, sequence_parallel)

    def context_parallel_spec(self) -> ContextParallelSpec:
        """The GPT's attention functions and RoPE tables, by module name relative to this module."""
        return gpt_context_parallel_spec("model.")

    def check_context_parallel(self, cp: int) -> None:
        """Raise before sharding when ``cp`` cannot split this model's sequences."""
        check_context_parallel(self.model_config, cp)

    def expert_parallel_spec(self) -> ExpertParallelSpec | None:
        """The GPT's MoE experts and its routers' token counts (``None`` for a dense GPT)."""
        return gpt_expert_parallel_spec("model.", self.model_config, self.model)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Tell the MoE blocks how the trainer scales the loss before its backward, for the balance and z losses they
        add to the gradient themselves (``moe.AddLoss``): ``1 / k`` under gradient accumulation over ``k`` batches,
        where Lightning divides the loss; 1 under a pipeline, whose gradients are scaled after the backward."""
        if self.model is None or not self.model_config.moe.enabled:
            return
        pipelined = getattr(getattr(self.trainer.strategy, "parallel_dims", None), "pp", 1) > 1
        scale = 1.0 if pipelined else 1.0 / self.trainer.accumulate_grad_batches
        for layer in moe_layers(self.model).values():
            layer.loss_scale = scale

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Balance the MoE experts: each router's bias steps toward the global batch's mean load (the strategy summed
        the counts over the data-parallel ranks); the load imbalance is logged on logging steps only."""
        if self.model is None or not self.model_config.moe.enabled:
            return
        summed = self.trainer.world_size == 1 or getattr(self.trainer.strategy, "sums_expert_load", False)
        if self.model_config.moe.balance_rate > 0 and not summed:
            raise ValueError(
                f"model.moe balances the experts by the global batch's load, which "
                f"{type(self.trainer.strategy).__name__} does not sum over its ranks (each rank would drift its own "
                "way); use lightning_dist's MeshStrategy or DataParallelStrategy, or model.moe.balance_rate=0."
            )
        shares, losses = update_expert_bias(self.model)
        if _compat.logs_this_step(self.trainer):
            for key, value in load_stats(shares, losses).items():  # the same on every data-parallel rank: no sync_dist
                self.log(key, value)

    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.optim_config
        # Weight decay on matrices only: norms, biases and embeddings are left alone (GPT-2 / Llama practice).
        # A tied head is the embedding matrix: a pipeline stage that holds only the head must not decay its copy.
        tied_head = self.model_config.tie_embeddings

        def is_embedding(name: str, param: nn.Parameter) -> bool:
            return "emb" in name or (tied_head and name.endswith("head.weight"))

        # Trained by epochs (max_steps=-1): the schedule spans the steps Lightning counts for them.
        length = self.max_steps if self.max_steps > 0 else self.trainer.estimated_stepping_batches
        return adamw_with_schedule(self.named_parameters(), cfg, is_embedding, cfg.decay_steps or int(length))


def _hidden_states_forward(stage: GPT, x: Tensor) -> Tensor:
    """A pipeline stage of the GPT that leaves the head to the chunked loss: its final hidden states, not logits."""
    return GPT.forward(stage, x, logits=False)


class StepLoss:
    """The training loss of an optimizer step: under gradient accumulation the mean over its micro batches (what one
    forward of the whole batch gives), known once the last of them ran."""

    def __init__(self) -> None:
        self._step, self._losses = -1, []

    def update(self, loss: Tensor, trainer: pl.Trainer) -> Tensor | None:
        """Add a micro batch's loss; returns the step's loss after its last micro batch, else ``None``."""
        if trainer.global_step != self._step:
            self._step, self._losses = trainer.global_step, []
        if hasattr(loss, "full_tensor"):  # a replicated DTensor under loss parallelism
            loss = loss.full_tensor()
        self._losses.append(loss.detach())
        if len(self._losses) < trainer.accumulate_grad_batches:
            return None
        return torch.stack(self._losses).mean()
