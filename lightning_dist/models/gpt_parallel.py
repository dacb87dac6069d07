"""How the reference GPT is split: its tensor-parallel plan and its context-parallel spec.

Kept next to ``gpt.py`` so the model file stays free of distributed code, and so a reader sees the model's
module names and the plan that refers to them side by side.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn import Module

from lightning_dist.models.gpt import GPTConfig
from lightning_dist.models.moe import expert_load
from lightning_dist.parallel.context import ContextParallelSpec
from lightning_dist.parallel.expert import ExpertParallelSpec


def gpt_expert_parallel_spec(prefix: str, cfg: GPTConfig, model: Module) -> ExpertParallelSpec | None:
    """The experts of every MoE block of the GPT ``model`` at ``prefix`` and its routers' token counts; ``None`` for
    a dense GPT."""
    if not cfg.moe.enabled:
        return None
    return ExpertParallelSpec(
        experts=(f"{prefix}layers.*.moe.experts",), num_experts=cfg.moe.num_experts, load=lambda: expert_load(model)
    )


def check_context_parallel(cfg: GPTConfig, cp: int) -> None:
    """Raise a one-line ``ValueError`` when ``cp`` cannot split this model's sequences."""
    if cp > 1 and cfg.arch != "llama":
        # gpt2's learned position embedding is looked up by arange(T) inside forward: no table to re-index.
        raise ValueError(f"cp={cp} with model.arch={cfg.arch!r}: context parallelism supports arch=llama; set cp=1.")
    if cp > 1 and cfg.moe.enabled and cfg.moe.aux_loss_coef > 0:
        raise ValueError(
            f"cp={cp} with model.moe.aux_loss_coef={cfg.moe.aux_loss_coef}: the sequence-wise balance loss needs each "
            "sequence whole, which cp splits; set model.moe.aux_loss_coef=0 (the bias balancing and the z-loss run "
            "under cp) or cp=1."
        )


def gpt_context_parallel_spec(prefix: str) -> ContextParallelSpec:
    """Every block's attention function, and the RoPE tables (rows by position) of the GPT at ``prefix``."""
    return ContextParallelSpec(
        attention=(f"{prefix}layers.*.attn",),
        positions=prefix.rstrip("."),  # "": the module itself
        position_tables=("rope_cos", "rope_sin"),
    )


def check_tensor_parallel(cfg: GPTConfig, tp: int, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """Raise a one-line ``ValueError`` when ``tp`` cannot split this model evenly."""
    if tp == 1:
        return
    if cfg.arch != "llama":
        raise ValueError(f"tp={tp} with model.arch={cfg.arch!r}: tensor parallelism supports arch=llama; set tp=1.")
    sizes = {
        "model.n_heads": cfg.n_heads,
        "model.n_kv_heads": cfg.kv_heads,
        "model.vocab_size": cfg.vocab_size,
    }
    if cfg.moe.dense_layers or not cfg.moe.enabled:
        sizes["the FFN hidden size (model.ffn_hidden)"] = cfg.hidden_dim
    if cfg.moe.enabled and cfg.moe.shared_experts:
        sizes["the shared experts' hidden size (model.moe.shared_experts x hidden)"] = (
            cfg.moe.shared_experts * cfg.expert_hidden
        )
    if sequence_parallel and seq_len is not None:
        sizes["data.seq_len (sequence parallelism shards it)"] = seq_len
    for name, size in sizes.items():
        if size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ValueError(f"tp={tp} does not divide {name}={size}; use a tp in {divisors[-6:]} or change the size.")


def gpt_tensor_parallel_plan(
    prefix: str, sequence_parallel: bool = True, loss_parallel: bool = True, cfg: GPTConfig | None = None
) -> dict[str, ParallelStyle]:
    """The Megatron-style plan for :class:`~lightning_dist.models.gpt.GPT` (llama arch), by module name.

    Attention q/k/v and MLP gate/up are column-parallel (each rank owns whole heads / hidden units, so head
    counts per rank follow from the sharded weights), o/down are row-parallel (one all-reduce, or a
    reduce-scatter with sequence parallelism, per sub-layer). With sequence parallelism the norms and the
    residual stream are sharded along the sequence dim. With loss parallelism the head's vocab-sharded logits
    go straight into the cross-entropy (no all-gather of a (B, T, V) tensor).

    An MoE block takes the whole sequence (gathered under sequence parallelism, its output cut back to this rank's
    part): its router stays whole on every tp rank (replicated), its shared experts are split like the MLP with their
    output summed over tp, and its routed experts are left to expert parallelism (``parallel/expert.py``), which runs
    them on each tp rank's part of the tokens.

    Args:
        prefix: Name of the GPT module inside the module being parallelized (``"model."`` for GPTModule).
        sequence_parallel: Shard norms and residuals along the sequence.
        loss_parallel: Keep logits vocab-sharded for a parallel cross-entropy.
        cfg: The model's configuration, for its MoE blocks; ``None`` = a dense GPT.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        f"{prefix}tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        f"{prefix}head": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan[f"{prefix}norm"] = SequenceParallel()
    block = f"{prefix}layers.*."
    if sequence_parallel:
        plan[f"{block}attn_norm"] = SequenceParallel()
        plan[f"{block}mlp_norm"] = SequenceParallel()
        # Gather the sequence before attention / MLP: they need every position (the rope tables stay local).
        plan[f"{block}attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
    moe = cfg is not None and cfg.moe.enabled
    dense = not moe or cfg.moe.dense_layers > 0
    if sequence_parallel and dense:
        plan[f"{block}mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan.update(
        {
            f"{block}attn.q_proj": ColwiseParallel(),
            f"{block}attn.k_proj": ColwiseParallel(),
            f"{block}attn.v_proj": ColwiseParallel(),
            f"{block}attn.o_proj": RowwiseParallel(output_layouts=seq),
        }
    )
    if dense:
        plan[f"{block}mlp.gate_proj"] = ColwiseParallel()
        plan[f"{block}mlp.up_proj"] = ColwiseParallel()
        plan[f"{block}mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
    if moe:
        if sequence_parallel:  # the router and the experts see every token of the sequence
            plan[f"{block}moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
        if cfg.moe.shared_experts:
            plan[f"{block}moe.shared.gate_proj"] = ColwiseParallel()
            plan[f"{block}moe.shared.up_proj"] = ColwiseParallel()
            plan[f"{block}moe.shared.down_proj"] = RowwiseParallel(output_layouts=Replicate())
    return plan
