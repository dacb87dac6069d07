"""Fine-tuning's settings, checked before launch: ``model.lora`` (LoRA, QLoRA's layouts, peft / torchao installed),
``checkpoint.save_hf`` (a model whose HuggingFace names a sharded write can give) and ``eval.*`` (lm-eval tasks during
training, on each evaluated checkpoint's HuggingFace save); and the default layout's DDP, which writes no checkpoint
folder, replaced by the mesh's replication for the runs that need one (:func:`replicate_on_the_mesh`). Torch-free:
the launcher runs them."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from lightning_dist.config.shapes import hf_config, planned_model
from lightning_dist.models.gpt_config import GPTConfig
from lightning_dist.models.lora_config import NF4_BLOCK, NF4_SCALER_BLOCK, LoraConfig


def check_finetune(cfg: Any, dims: Any) -> None:
    """The rules below, for the run's config (a ``TrainConfig``) and layout (its ``ParallelDims``); a user's own
    module has no ``model.lora``."""
    lora = getattr(cfg.model, "lora", None)
    if lora is not None:
        check_lora(lora)
        if lora.quantize is not None:
            check_qlora(cfg, dims)
        if lora.enabled and cfg.parallelism.float8 != "off":
            # float8 would convert the frozen base layers and the adapters alike: not checked against one process.
            raise ValueError(
                f"model.lora with parallelism.float8={cfg.parallelism.float8}: float8 LoRA is not supported (it would "
                "convert the adapters too); set parallelism.float8=off."
            )
    if cfg.checkpoint.save_hf:
        check_save_hf(cfg.model)
    if cfg.eval.tasks:
        check_eval(cfg)


def replicate_on_the_mesh(cfg: Any) -> str | None:
    """``parallelism=ddp`` (the default) for a run that needs a sharded checkpoint folder: ``checkpoint.save_hf``
    (its ``hf/`` lives in the checkpoint's folder) or QLoRA (``model.lora.quantize``: its 4-bit base is saved and
    read back as such, where Lightning's DDP reads its one-file checkpoints before the base is quantized). Lightning's
    DDP writes each checkpoint as one file, so such a run replicates on the mesh instead: ``parallelism.strategy=fsdp``
    with ``dp_shard=1`` and ``dp_replicate`` over the world, FSDP2 replicating every weight, which is DDP's math (one
    process's, as every layout). ``cfg.parallelism`` is replaced so; returns the line that says so (``None``: nothing
    to do).

    Raises:
        ValueError: ``parallelism.ddp.comm_hook`` set (DDP's hooks have no place on the mesh; one line).
    """
    par = cfg.parallelism
    lora = getattr(cfg.model, "lora", None)
    quantize = lora.quantize if lora is not None and lora.enabled else None
    needs = ["checkpoint.save_hf=true"] if cfg.checkpoint.save_hf else []
    needs += [f"model.lora.quantize={quantize}"] if quantize is not None else []
    if par.strategy != "ddp" or not needs:
        return None
    what = " and ".join(needs)
    if par.ddp.comm_hook is not None:
        raise ValueError(
            f"{what} with parallelism.ddp.comm_hook={par.ddp.comm_hook}: the run needs a checkpoint folder, which "
            "Lightning's DDP does not write, and the mesh's replication has no DDP hooks; set "
            "parallelism.ddp.comm_hook=null (parallelism.fsdp.reduce_dtype=bf16 halves the gradient bytes there)."
        )
    cfg.parallelism = replace(par, strategy="fsdp", dp_shard=1)  # dp_replicate: parallelism=ddp's (the world)
    return (
        f"note: {what} needs a checkpoint folder, which Lightning's DDP does not write: parallelism=ddp runs as the "
        "mesh's replication (parallelism.strategy=fsdp parallelism.dp_shard=1: FSDP2 replicating every weight, "
        "the same math)"
    )


def check_lora(lora: LoraConfig) -> None:
    """``model.lora``: its values, and peft installed (one line each)."""
    lora.check()
    if lora.enabled and importlib.util.find_spec("peft") is None:
        raise ValueError(f"model.lora.rank={lora.rank} needs peft: pip install 'lightning-dist[hf]' (or set rank 0).")


def check_qlora(cfg: Any, dims: Any) -> None:
    """``model.lora.quantize`` (QLoRA, ``models/qlora.py``): torchao installed, a layout the 4-bit base runs under
    (one line each)."""
    what = f"model.lora.quantize={cfg.model.lora.quantize} (QLoRA)"
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"{what} needs torchao: pip install 'lightning-dist[qlora]' (or model.lora.quantize=null).")
    if getattr(cfg.model, "kind", None) == "hf" and _hf_model_type(cfg.model) in ("gpt2",):
        raise ValueError(
            f"{what} with a GPT-2 model: its layers are transformers' Conv1D, which torchao's NF4 does not compute "
            "with; use a Llama-style family (Llama, Qwen2, Mistral) or model.lora.quantize=null."
        )
    for layer, numel in _block_linear_sizes(cfg.model).items():
        if numel % (NF4_BLOCK * NF4_SCALER_BLOCK):
            raise ValueError(
                f"{what}: the blocks' {layer} weight has {numel} values, not a multiple of "
                f"{NF4_BLOCK * NF4_SCALER_BLOCK} (NF4's blocks of {NF4_BLOCK} in groups of {NF4_SCALER_BLOCK}); use a "
                "model whose widths are multiples of 128, or model.lora.quantize=null."
            )
    if dims.tp > 1:
        raise ValueError(
            f"{what} under tp={dims.tp}: tensor parallelism shards each base weight, and NF4 is quantized from a "
            "whole one (torchao's NF4 has no tensor-parallel layout here); set parallelism.tp=1 (fsdp / cp / "
            "replication keep the 4-bit base whole on every rank), or model.lora.quantize=null."
        )
    if dims.pp > 1:
        raise ValueError(
            f"{what} under pp={dims.pp}: not wired for pipeline stages yet (each stage would quantize its own "
            "layers; untested); set parallelism.pp=1 (fsdp keeps the 4-bit base whole on every rank), or "
            "model.lora.quantize=null."
        )


def _block_linear_sizes(model: Any) -> dict[str, int]:
    """The values in each linear weight of a block, for the built-in GPT and Llama-family HuggingFace models (the
    planner's shapes); {} for another model (``models/qlora.py`` checks its layers once built)."""
    try:
        cfg = planned_model(model)
    except ValueError:
        return {}
    h, f, q, kv = cfg.d_model, cfg.hidden_dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    sizes = {"q_proj": h * q, "k_proj": h * kv, "v_proj": h * kv, "o_proj": q * h}
    if cfg.moe.num_experts > 0:  # the experts are stacked tensors, not linear layers (only the router is one)
        return sizes
    sizes.update({"up_proj": h * f, "down_proj": f * h})
    return {**sizes, "gate_proj": h * f} if cfg.arch == "llama" else sizes


def _hf_model_type(model: Any) -> str | None:
    """``model=hf``'s family (``config.json``'s ``model_type``) where it is known before launch."""
    return getattr(hf_config(model), "model_type", None)


def check_save_hf(model: Any) -> None:
    """``checkpoint.save_hf``: a model whose HuggingFace weights a sharded write can name (one line otherwise)."""
    if isinstance(model, GPTConfig) and model.arch != "llama":
        raise ValueError(
            f"checkpoint.save_hf=true with model.arch={model.arch}: its HuggingFace weights are fused from ours, which "
            "a sharded write cannot do; export them after the run (lightning-dist-export RUN OUT), or use arch=llama."
        )
    if not isinstance(model, GPTConfig) and getattr(model, "kind", None) != "hf":
        raise ValueError(
            "checkpoint.save_hf=true with your own LightningModule: it has no HuggingFace names; save them in your "
            "module, or set checkpoint.save_hf=false."
        )


def check_eval(cfg: Any) -> None:
    """``eval.*`` during training: lm-eval installed, a HuggingFace save at each evaluated step (one line each)."""
    every, saved = cfg.eval.every_n_steps or cfg.checkpoint.every_n_steps, cfg.checkpoint.every_n_steps
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"eval.tasks={cfg.eval.tasks} needs lm-eval: pip install 'lightning-dist[eval]'.")
    if not cfg.checkpoint.save_hf or not saved or every % saved:
        raise ValueError(
            f"eval.tasks={cfg.eval.tasks} evaluates each checkpoint's HuggingFace save: set checkpoint.save_hf=true "
            f"and checkpoint.every_n_steps to a divisor of eval.every_n_steps ({every})."
        )
    if not cfg.trainer.enable_checkpointing:
        raise ValueError("eval.tasks needs the run's checkpoints: set trainer.enable_checkpointing=true.")
