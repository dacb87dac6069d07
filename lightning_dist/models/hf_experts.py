"""Where a transformers MoE family keeps its experts, for expert parallelism (``parallelism.ep``).

transformers 5's MoE families (Mixtral, Qwen2-MoE / Qwen3-MoE, OLMoE, DeepSeek, GPT-OSS, ...) keep each block's
experts in one module (``MixtralExperts``, ``Qwen3MoeExperts``, ...) whose weights are stacked on dim 0 and whose
forward is ``experts(hidden_states (N, C), top_k_index (N, K), top_k_weights (N, K)) -> (N, C)``, the router run
before it by the block. That is the contract :mod:`lightning_dist.parallel.expert` takes, so the family's own experts
code runs on each rank's experts (its ``num_experts`` read as the local count), whichever experts implementation the
model was built with (``eager``, ``grouped_mm``, ``batched_mm``).

A family whose experts have another interface (GraniteMoE's ``ParallelExperts(inputs, expert_size)``, Jamba's and
others' lists of per-expert MLPs) has no spec: ``ep > 1`` is refused for it in one line. Needs the optional extra
``lightning-dist[hf]``; no distributed code here.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_dist.parallel.expert import ExpertParallelSpec

#: The arguments of the experts interface, in order.
EXPERTS_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of the interface above: an integer ``num_experts``, its own parameters
    (and no child's) stacked one row per expert on dim 0, and a forward taking ``EXPERTS_ARGS``."""
    count = getattr(module, "num_experts", None)
    params = list(module.named_parameters(recurse=False))
    if not isinstance(count, int) or count < 1 or not params:
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    if any(param.dim() < 2 or param.shape[0] != count for _, param in params):
        return False
    try:
        names = tuple(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names == EXPERTS_ARGS


def hf_expert_parallel_spec(model: nn.Module, prefix: str = "") -> ExpertParallelSpec | None:
    """The experts modules of a transformers causal LM, by name (``prefix`` before each), or ``None`` where it has
    none of the stacked interface.

    Raises:
        ValueError: Its MoE blocks hold different numbers of experts (one line).
    """
    found = {name: module for name, module in model.named_modules() if is_stacked_experts(module)}
    if not found:
        return None
    counts = {module.num_experts for module in found.values()}
    if len(counts) > 1:
        raise ValueError(
            f"{type(model).__name__}'s MoE blocks hold {sorted(counts)} experts: expert parallelism splits one number "
            "of experts per block; set parallelism.ep=1."
        )
    return ExpertParallelSpec(experts=tuple(f"{prefix}{name}" for name in found), num_experts=counts.pop())
