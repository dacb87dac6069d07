"""HuggingFace decoder-only causal LMs under every layout, with no wrapper of the user's own.

:class:`HFCausalLM` is a LightningModule around a ``transformers`` causal LM (Llama, Qwen2, Mistral and the other
models laid out as ``model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head``). It implements the
:class:`~lightning_dist.contract.ParallelModule` hooks:

- tensor parallelism with the plan the model ships (``model.tp_plan``: ``colwise``, ``rowwise``,
  ``embedding_rowwise``, ``colwise_gather_output``, ...) mapped to torch's ``ParallelStyle``s; GPT-2 (no shipped
  plan, ``Conv1D`` layers) gets its MLP sharded with Conv1D styles and its attention replicated;
- pipeline parallelism through a stage forward that runs whatever part of the model a stage holds (embedding, its
  decoder layers with the rotary tables / positions and causal mask rebuilt locally, final norm, head), under the
  model's own parameter names; a tied embedding and head on different stages train as one weight;
- context parallelism (Llama, Qwen2, Mistral without sliding window) through transformers' attention-function hook
  and the model's ``position_ids`` (see ``hf_context.py``);
- meta-device construction from a config (``reset_parameters``: each rank initializes only what it holds, with the
  one-process values, see ``hf_init.py``), and the run's optimizer config (AdamW, warmup + cosine).

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here: the strategies apply it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_dist import _compat
from lightning_dist.models.hf_context import check_context_parallel, hf_context_parallel_spec
from lightning_dist.models.hf_experts import hf_expert_parallel_spec
from lightning_dist.models.hf_families import check_family
from lightning_dist.models.hf_init import build_causal_lm, causal_lm_class, init_causal_lm
from lightning_dist.models.hf_loss import hf_chunked_loss
from lightning_dist.models.hf_parallel import hf_tensor_parallel_plan
from lightning_dist.models.hf_pipeline import hf_layout, hf_stage_forward
from lightning_dist.models.lora import apply_lora, init_lora, to_keeping_adapters
from lightning_dist.models.lora_config import LoraConfig
from lightning_dist.models.loss import IGNORE_INDEX as IGNORE_INDEX  # re-exported (hf.IGNORE_INDEX)
from lightning_dist.models.loss import split_token_batch, token_loss
from lightning_dist.models.module import StepLoss
from lightning_dist.models.optim import OptimConfig, adamw_with_schedule
from lightning_dist.models.qlora import NF4_NAMES, base_linears, nf4_names, quantize_base
from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.expert import ExpertParallelSpec
from lightning_dist.parallel.pipeline import PipelineSpec

_TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_TINY_GPT2 = {
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_positions": 256,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
#: ``model=hf model.config=<name>``: tiny configs of the families we test (built locally, nothing downloaded).
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_llama": ("LlamaConfig", _TINY),
    "tiny_qwen2": ("Qwen2Config", _TINY),
    "tiny_mistral": ("MistralConfig", {**_TINY, "sliding_window": None}),
    "tiny_gpt2": ("GPT2Config", _TINY_GPT2),
}


def split_causal_batch(batch: Any) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(inputs, targets)`` for next-token prediction from the batch formats people use, or
    ``(inputs, targets, {"scale": ...})`` for a masked ``(inputs, targets, norm)`` batch (data=hf ``instruction`` /
    ``chat``: the loss keyword arguments of :func:`causal_lm_loss`, see ``lightning_dist/models/loss.py``).

    A ``(B, T+1)`` token tensor; an ``(inputs, targets)`` pair; or a dict with ``input_ids`` and optionally HF-style
    ``labels`` (the same positions as ``input_ids``, ``-100`` = ignored). The last two keep the logits of positions
    ``0..T-2`` exactly as HF computes them (a causal model does not look ahead).
    """
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        labels = batch.get("labels", ids)
        return ids[:, :-1], labels[:, 1:]
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return split_token_batch(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(batch, Tensor) and batch.ndim == 2:
        return batch[:, :-1], batch[:, 1:]
    raise ValueError(
        f"a batch of {type(batch).__name__} is not a causal-LM batch; give a (B, T+1) token tensor, an "
        "(inputs, targets) pair, an (inputs, targets, norm) triple, or a dict with input_ids (and labels)."
    )


def causal_lm_loss(logits: Tensor, targets: Tensor, scale: Tensor | None = None) -> Tensor:
    """Mean next-token cross-entropy in float32 over the targets that are not ``-100``; with ``scale`` (masked data:
    the step's ``G / N``) ``sum * scale / B``, this micro batch's share of the global batch's token mean."""
    return token_loss(logits, targets, scale)


class HFCausalLM(pl.LightningModule):
    """Train a transformers causal LM with any lightning-dist layout (or none).

    Example::

        model = LlamaForCausalLM(LlamaConfig(...))
        Trainer(strategy=TensorParallelStrategy(tp=2), devices=2).fit(HFCausalLM(model), loader)
        # From a config: built on the meta device, each rank materializes only its shards / stages.
        Trainer(strategy=PipelineParallelStrategy(pp=2), devices=2).fit(HFCausalLM(LlamaConfig(...)), loader)
        # Pretrained: each rank reads its slices of the safetensors once the layout is applied.
        Trainer(..., callbacks=[InitWeights(folder)]).fit(HFCausalLM(AutoConfig.from_pretrained(folder),
                                                                     random_init=False, hf_source=folder), loader)

    Args:
        model: A ``transformers`` causal LM laid out as ``model.embed_tokens / model.layers / model.norm /
            model.rotary_emb / lm_head`` (Llama, Qwen2, Mistral, ...), or GPT-2; its values are kept (a model on the
            meta device is initialized by :meth:`reset_parameters`). Or its config: the model is then built in
            ``configure_model`` (on the meta device under our strategies, see :meth:`reset_parameters`).
        optim: AdamW + warmup / cosine schedule, weight decay on matrices only (default ``OptimConfig()``).
        max_steps: Length of the schedule; ``None`` = ``optim.decay_steps``, else the trainer's ``max_steps``.
        lr: Overrides ``optim.lr``.
        weight_decay: Overrides ``optim.weight_decay``.
        init_seed: Seed of the per-parameter initialization (the same values on every layout).
        random_init: ``False`` when every weight is read right after materializing (a pretrained folder through
            ``InitWeights``, a checkpoint): :meth:`reset_parameters` then only zeroes them instead of drawing them.
        hf_source: The HuggingFace folder the weights come from, kept in the checkpoint so ``lightning-dist-export``
            copies its tokenizer and generation config next to the exported weights.
        allow_untested_family: Run layouts of a family the family matrix does not list (``hf_families.py``).
        lora: Low-rank adapters trained on the frozen model (``models/lora.py``); ``None`` / rank 0: every weight.
    """

    def __init__(
        self,
        model: nn.Module | Any,
        optim: OptimConfig | None = None,
        max_steps: int | None = None,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        init_seed: int = 0,
        random_init: bool = True,
        hf_source: str | None = None,
        allow_untested_family: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        super().__init__()
        given = {"lr": lr, "weight_decay": weight_decay}
        self.optim_config = replace(optim or OptimConfig(), **{k: v for k, v in given.items() if v is not None})
        self.max_steps = max_steps
        self.init_seed = init_seed
        self.random_init = random_init
        built = isinstance(model, nn.Module)
        self._built, self.allow_untested_family = built, allow_untested_family
        self.hf_model_config = model.config if built else model
        self.model: nn.Module | None = model if built else None
        # The checkpoint names its model: lightning-dist-export writes the HuggingFace folder back from these.
        architecture = type(model) if built else causal_lm_class(model)
        config = {**self.hf_model_config.to_dict(), "architectures": [architecture.__name__]}
        hparams = {"hf_config": config, "optim": asdict(self.optim_config), "max_steps": max_steps}
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:  # the export writes a peft adapter folder (or merges) from it
            hparams["lora"] = asdict(self.lora)
        self.save_hyperparameters({**hparams, "hf_source": hf_source} if hf_source else hparams, logger=False)
        self.step_loss = StepLoss()
        self._nonembedding_params: int | None = None
        self.loss_chunks = 0  # the head and loss in this many pieces of the tokens (set_loss_chunks); 0 = whole
        if built and self.lora is not None:  # a built model keeps its values; its adapters get theirs
            apply_lora(model, self.lora, hf_layout(model).blocks)
            init_lora(model, init_seed)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.to``, but LoRA adapters stay float32 when the module is converted to bf16 (``bf16-true``)."""
        return to_keeping_adapters(super().to, self, *args, **kwargs)

    def configure_model(self) -> None:
        """Build the model from its config on the meta device; outside our strategies' meta context (one device,
        Lightning's DDP) allocate it here and initialize it as :meth:`reset_parameters` does."""
        if self.model is not None:
            return
        self.model = build_causal_lm(self.hf_model_config)
        if self.lora is not None:  # adapters on the frozen model, built on the meta device too (models/lora.py)
            apply_lora(self.model, self.lora, hf_layout(self.model).blocks)
        device = torch.get_default_device()  # the strategy's init context: meta under our mesh layouts
        if device.type != "meta":
            self.model.to_empty(device=device)
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize what this rank holds after a strategy materialized it from the meta device: every parameter
        its one-process value (seeded by its name, see :func:`~lightning_dist.models.hf_init.init_causal_lm`), or
        zeros when ``random_init=False`` (the weights are read next); the rotary tables computed again."""
        init_causal_lm(self.model, self.init_seed, random=self.random_init)
        init_lora(self.model, self.init_seed)  # the adapters are never read from pretrained weights

    def on_fit_start(self) -> None:
        """QLoRA (``model.lora.quantize``): the frozen base stored in 4 bits once its weights are in place (a pretrained
        folder is read, the precision applied) and before a checkpoint being continued is read into it."""
        if self.lora is not None and self.lora.quantize is not None:
            quantize_base(self.model, hf_layout(self.model).blocks, self.lora.quantize)

    def unsharded_parameters(self) -> list[nn.Parameter]:
        """QLoRA: the frozen base FSDP2 leaves whole on every rank, each weight quantized from its whole loaded value
        (as one process quantizes it); the adapters, embedding, norms and head are sharded as usual."""
        if not (self.lora is not None and self.lora.quantize is not None):
            return []
        return [layer.weight for layer in base_linears(self.model, hf_layout(self.model).blocks).values()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A QLoRA checkpoint names its NF4 tensors (saved as they are: a resumed run continues on the same base)."""
        if names := nf4_names(self):
            checkpoint[NF4_NAMES] = names

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), counted as for the built-in GPT (PaLM's estimate):
        ``6 * N + 12 * L * H * Q * T`` with N the whole model's parameters but its input and position embeddings (a
        tied head counted once, as the head), L layers, H query heads of width Q, T ``seq_len``. For the telemetry's
        TFLOP/s and MFU; counted once, on a meta-device copy (this rank may hold a shard or a stage only)."""
        if self._nonembedding_params is None:
            whole = build_causal_lm(self.hf_model_config)
            skip = {id(m.weight) for m in whole.modules() if isinstance(m, nn.Embedding)}
            head = whole.get_output_embeddings()
            if head is not None:
                skip.discard(id(head.weight))
            self._nonembedding_params = sum(p.numel() for p in whole.parameters() if id(p) not in skip)
        config = self.hf_model_config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return float(6 * self._nonembedding_params + 12 * config.num_hidden_layers * heads * head_dim * seq_len)

    def compute_loss(self, batch: Any) -> Tensor:
        """The loss of one batch. No KV cache: a recomputed layer (activation checkpointing) would append to it."""
        inputs, targets, *loss_kwargs = split_causal_batch(batch)
        kwargs = loss_kwargs[0] if loss_kwargs else {}
        if self.loss_chunks:  # the head and loss in pieces of the tokens (models/hf_loss.py)
            return hf_chunked_loss(self.model, inputs, targets, self.loss_chunks, **kwargs)
        logits = self.model(input_ids=inputs, use_cache=False).logits
        return causal_lm_loss(logits, targets, **kwargs)

    def set_loss_chunks(self, chunks: int) -> None:
        """The head and loss in ``chunks`` pieces of the tokens, recomputed in the backward (0: whole); not under pp.

        Raises:
            ValueError: The family matrix does not vouch for the chunked loss of this family (one line).
        """
        if chunks > 0:
            start = None if self._built else "init" if self.random_init else "pretrained"
            check_family(self.hf_model_config, {}, start, self.allow_untested_family, loss_chunks=chunks)
        self.loss_chunks = chunks

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        step_loss = self.step_loss.update(loss, self.trainer)  # the optimizer step's loss, every micro batch in
        if step_loss is not None and _compat.logs_this_step(self.trainer):  # as GPTModule: logging steps only
            self.log("train/loss", step_loss, sync_dist=True)
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.compute_loss(batch), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW and the warmup / cosine schedule of ``optim`` (as the built-in GPT): weight decay on matrices only,
        not on norms, biases or embeddings (nor on a head tied to the embedding, on a stage that holds only it)."""
        cfg = self.optim_config
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        tied_head = getattr(self.hf_model_config, "tie_word_embeddings", False)

        def is_embedding(name: str, param: nn.Parameter) -> bool:
            return id(param) in embeddings or (tied_head and name.endswith("lm_head.weight"))

        length = cfg.decay_steps or self.max_steps or self.trainer.max_steps
        if length <= 0:  # trained by epochs (max_steps=-1): the steps Lightning counts for them
            length = int(self.trainer.estimated_stepping_batches)
        return adamw_with_schedule(self.named_parameters(), cfg, is_embedding, length)

    # ------------------------------------------------------------------------------- parallelism contract
    def tensor_parallel_plan(self, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, Any]:
        """The model's shipped plan (logits gathered whole: HF's own ``colwise_gather_output`` head)."""
        return hf_tensor_parallel_plan(self.model, hf_layout(self.model).blocks, prefix="model.")

    def context_parallel_spec(self) -> ContextParallelSpec:
        """The attention modules (routed through transformers' attention hook) and the model taking ``position_ids``."""
        return hf_context_parallel_spec(self.model, hf_layout(self.model).blocks, "model.")

    def expert_parallel_spec(self) -> ExpertParallelSpec | None:
        """The family's own experts modules (``hf_experts.py``); ``None`` for a dense family or experts of another
        interface."""
        return hf_expert_parallel_spec(self.model, prefix="model.")

    def check_expert_parallel(self, ep: int) -> None:
        """Raise before sharding when the family matrix does not vouch for expert parallelism of this family."""
        self._check_family({"ep": ep})

    def check_context_parallel(self, cp: int) -> None:
        """Raise before sharding when ``cp`` cannot split this model's sequences (see ``hf_context.py``) or the family
        matrix does not vouch for it (``hf_families.py``)."""
        check_context_parallel(self.hf_model_config, cp)
        self._check_family({"cp": cp})

    def check_tensor_parallel(self, tp: int, sequence_parallel: bool = True) -> None:
        """Raise before sharding when the family matrix does not vouch for tensor parallelism of this family."""
        self._check_family({"tp": tp})

    def _check_family(self, degrees: dict[str, int]) -> None:
        start = None if self._built else "init" if self.random_init else "pretrained"
        check_family(self.hf_model_config, degrees, start, self.allow_untested_family)

    def pipeline_spec(self) -> PipelineSpec:
        """Decoder layers as blocks, the decoder's parts before them first, its parts after them and the head last,
        each stage running the model's own forward (``hf_pipeline.py``); read off the model, for any family.

        Raises:
            ValueError: A layout a stage cannot run (one line).
        """
        layout = hf_layout(self.model)
        return PipelineSpec(
            model_attr="model",
            blocks_attr=layout.blocks,
            first=layout.first,
            last=layout.last,
            loss_fn=causal_lm_loss,
            split_batch=split_causal_batch,
            stage_forward=functools.partial(hf_stage_forward, layout=layout),
        )
