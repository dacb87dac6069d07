"""HuggingFace decoder-only causal LMs under every layout, with no wrapper of the user's own.

:class:`HFCausalLM` is a LightningModule around a ``transformers`` causal LM (Llama, Qwen2, Mistral and the other
models laid out as ``model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head``). It implements the
:class:`~lightning_dist.contract.ParallelModule` hooks:

- tensor parallelism with the plan the model ships (``model.tp_plan``: ``colwise``, ``rowwise``,
  ``embedding_rowwise``, ``colwise_gather_output``, ...) mapped to torch's ``ParallelStyle``s;
- pipeline parallelism through a stage forward that runs whatever part of the model a stage holds (embedding, its
  decoder layers with the rotary tables and causal mask rebuilt locally, final norm, head), under the model's own
  parameter names.

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here: the strategies apply it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_dist.parallel.pipeline import PipelineSpec

#: transformers' tensor-parallel style names -> torch styles (outputs as plain tensors, full where HF gathers).
_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
}
_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
#: ``model=hf model.config=<name>``: tiny configs of the families we test (built locally, nothing downloaded).
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_llama": ("LlamaConfig", _TINY),
    "tiny_qwen2": ("Qwen2Config", _TINY),
    "tiny_mistral": ("MistralConfig", {**_TINY, "sliding_window": None}),
}
#: The parts of a Llama-style causal LM, by attribute path.
_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
IGNORE_INDEX = -100


def hf_tensor_parallel_plan(model: nn.Module, prefix: str = "") -> dict[str, ParallelStyle]:
    """The tensor-parallel plan a transformers model ships (``model.tp_plan``), as torch styles under ``prefix``."""
    shipped = dict(getattr(model, "tp_plan", None) or {})
    if not shipped:
        raise ValueError(
            f"{type(model).__name__} ships no tensor-parallel plan (model.tp_plan is empty); pass "
            "plan={'model.layers.*.self_attn.q_proj': 'colwise', ...} to the strategy, or use tp=1."
        )
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in shipped.items():
        if style not in _HF_STYLES:
            raise ValueError(
                f"{type(model).__name__}.tp_plan[{pattern!r}] = {style!r} has no torch equivalent here (known: "
                f"{sorted(_HF_STYLES)}); pass plan= to the strategy with torch ParallelStyles for this model."
            )
        plan[prefix + pattern] = _HF_STYLES[style]()
    return plan


def split_causal_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` for next-token prediction from the batch formats people use.

    A ``(B, T+1)`` token tensor; an ``(inputs, targets)`` pair; or a dict with ``input_ids`` and optionally HF-style
    ``labels`` (the same positions as ``input_ids``, ``-100`` = ignored). The last two keep the logits of positions
    ``0..T-2`` exactly as HF computes them (a causal model does not look ahead).
    """
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        labels = batch.get("labels", ids)
        return ids[:, :-1], labels[:, 1:]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(batch, Tensor) and batch.ndim == 2:
        return batch[:, :-1], batch[:, 1:]
    raise ValueError(
        f"a batch of {type(batch).__name__} is not a causal-LM batch; give a (B, T+1) token tensor, an "
        "(inputs, targets) pair, or a dict with input_ids (and labels)."
    )


def causal_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in float32 over the targets that are not ``-100``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def causal_lm_stage_forward(self: nn.Module, hidden: Tensor) -> Tensor:
    """Forward of one pipeline stage of a Llama-style causal LM (``self`` is the stage's view of the model).

    Runs the embedding only where the stage holds it, then its decoder layers with the rotary tables and the causal
    mask made from the local sequence (every stage keeps ``rotary_emb``: buffers only), then norm and head where held.
    """
    from transformers.masking_utils import create_causal_mask

    inner = self.model
    if inner.embed_tokens is not None:
        hidden = inner.embed_tokens(hidden)
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(
        config=inner.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=position_ids
    )
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
    if inner.norm is not None:
        hidden = inner.norm(hidden)
    if self.lm_head is not None:
        hidden = self.lm_head(hidden)
    return hidden


class HFCausalLM(pl.LightningModule):
    """Train a transformers causal LM with any lightning-dist layout (or none).

    Example::

        model = LlamaForCausalLM(LlamaConfig(...))
        Trainer(strategy=TensorParallelStrategy(tp=2), devices=2).fit(HFCausalLM(model), loader)
        Trainer(strategy=PipelineParallelStrategy(pp=2), devices=2).fit(HFCausalLM(model), loader)

    Args:
        model: A ``transformers`` causal LM laid out as ``model.embed_tokens / model.layers / model.norm /
            model.rotary_emb / lm_head`` (Llama, Qwen2, Mistral, ...).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay

    def compute_loss(self, batch: Any) -> Tensor:
        inputs, targets = split_causal_batch(batch)
        return causal_lm_loss(self.model(input_ids=inputs).logits, targets)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.compute_loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    # ------------------------------------------------------------------------------- parallelism contract
    def tensor_parallel_plan(self, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, Any]:
        """The model's shipped plan (logits gathered whole: HF's own ``colwise_gather_output`` head)."""
        return hf_tensor_parallel_plan(self.model, prefix="model.")

    def pipeline_spec(self) -> PipelineSpec:
        """Decoder layers as blocks; embedding first; final norm and head last; the stage forward above."""
        missing = [part for part in _PARTS if not _has_path(self.model, part)]
        if missing:
            raise ValueError(
                f"{type(self.model).__name__} is not laid out like a Llama-style causal LM (no {', '.join(missing)}); "
                "pipeline it with your own LightningModule and pipeline_spec() (see lightning_dist.PipelineSpec)."
            )
        attn = getattr(self.model.config, "_attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn!r} is untested under pipelines here; load with 'sdpa'.")
        return PipelineSpec(
            model_attr="model",
            blocks_attr="model.layers",
            first=("model.embed_tokens",),
            last=("model.norm", "lm_head"),
            loss_fn=causal_lm_loss,
            split_batch=split_causal_batch,
            stage_forward=causal_lm_stage_forward,
        )


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True
