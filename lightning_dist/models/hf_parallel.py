"""Tensor parallelism for transformers causal LMs: the plan a family ships, in torch's styles, or one derived.

A family's shipped plan (``model.tp_plan``, from its ``base_model_tp_plan``) names styles that
:data:`lightning_dist.parallel.tensor.STYLE_NAMES` resolves (``colwise``, ``rowwise``, ``colwise_gather_output``,
``rowwise_split_input``, ``replicated_with_grad_allreduce``, ...). Its expert entries (``*.experts*``: Mixtral's
packed expert weights) are left out: the experts stay whole on every tp rank, the attention and the dense parts are
sharded (expert parallelism is ``parallelism.ep``). A family that ships none gets the Llama plan where its decoder
layers have Llama's projections (``q_proj`` ... ``down_proj``); GPT-2 (``Conv1D`` layers) gets its MLP sharded.
Anything else needs a plan given by ``parallelism.tensor.plan``.

Needs the optional extra ``lightning-dist[hf]`` (transformers). No distributed code here: the strategies apply it.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dist.parallel.tensor import STYLE_NAMES, resolve_style

#: The Llama projections: a family without a shipped plan whose decoder layers have all of them is sharded so.
_LLAMA_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


class _Conv1DStyle(ParallelStyle):
    """Column- or row-wise sharding of transformers' ``Conv1D`` (a linear layer whose weight is stored (in, out)).

    torch's styles take ``nn.Linear`` only. Colwise: weight ``Shard(1)``, bias ``Shard(0)``, replicated input, output
    sharded on its last dim (local). Rowwise: weight ``Shard(0)``, bias replicated, input sharded on its last dim,
    output all-reduced (local). The layer's own ``addmm`` runs on DTensors, which sum the partial products.
    """

    def __init__(self, rowwise: bool) -> None:
        super().__init__()
        self.rowwise = rowwise

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:

        weight_placement, bias_placement = (Shard(0), Replicate()) if self.rowwise else (Shard(1), Shard(0))
        input_placement, output_placement = (Shard(-1), Replicate()) if self.rowwise else (Replicate(), Shard(-1))

        def partition(name: str, submodule: nn.Module, mesh: Any) -> None:
            for pname, param in list(submodule.named_parameters(recurse=False)):
                placement = weight_placement if pname == "weight" else bias_placement
                submodule.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def inputs(_: nn.Module, args: tuple, mesh: Any) -> tuple:
            return (DTensor.from_local(args[0], mesh, [input_placement], run_check=False), *args[1:])

        def outputs(_: nn.Module, output: Any, mesh: Any) -> Any:
            return output.redistribute(placements=[output_placement]).to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)


#: GPT-2 (transformers ships no plan): the MLP's Conv1D pair sharded; attention replicated, since its fused q/k/v
#: projection cannot be split by a column shard without reordering (and so checkpointing) the weight.
_GPT2_PLAN = {"transformer.h.*.mlp.c_fc": False, "transformer.h.*.mlp.c_proj": True}


def hf_tensor_parallel_plan(model: nn.Module, blocks: str, prefix: str = "") -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of the transformers ``model`` (see the module docstring), under ``prefix``.

    Args:
        model: The causal LM.
        blocks: Path of its decoder-layer list (``model.layers``), for a derived plan's patterns.
        prefix: Put before every pattern (names relative to the LightningModule: ``"model."``).

    Raises:
        ValueError: No plan can be shipped, derived or mapped (one line naming ``parallelism.tensor.plan``).
    """
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "model_type", None) == "gpt2":
        return {prefix + pattern: _Conv1DStyle(rowwise) for pattern, rowwise in _GPT2_PLAN.items()}
    names = [n for n, _ in model.named_modules() if n]
    # A family's plan names every kind of layer it has (Qwen3-MoE's dense MLP beside the sparse one); a config with
    # none of one kind leaves its entries matching nothing, which a plan given by hand is refused for (a typo).
    shipped = {
        p: s
        for p, s in dict(getattr(model, "tp_plan", None) or {}).items()
        if ".experts" not in p and any(fnmatch.fnmatchcase(n, p) for n in names)
    }
    if not shipped:
        shipped = _llama_plan(model, blocks)
    if not shipped:
        raise ValueError(
            f"{name} ships no tensor-parallel plan and its layers are not Llama's (q_proj ... down_proj); give "
            "parallelism.tensor.plan=<a YAML file of module pattern: style> (styles: colwise, rowwise, ...), or use "
            "tp=1."
        )
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in shipped.items():
        if style not in STYLE_NAMES:
            raise ValueError(
                f"{name}.tp_plan[{pattern!r}] = {style!r} has no torch style here (known: {sorted(STYLE_NAMES)}); "
                "give parallelism.tensor.plan=<a YAML file of module pattern: style> for this model, or use tp=1."
            )
        plan[prefix + pattern] = resolve_style(style)
    return plan


def _llama_plan(model: nn.Module, blocks: str) -> dict[str, str]:
    """The Llama plan under ``blocks.*`` when every decoder layer has every Llama projection as an ``nn.Linear``."""
    layers = list(model.get_submodule(blocks).children()) if blocks else []
    for layer in layers or [None]:
        names = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)} if layer is not None else set()
        if not all(any(fnmatch.fnmatchcase(n, key) for n in names) for key in _LLAMA_PLAN):
            return {}
    return {f"{blocks}.*.{key}": style for key, style in _LLAMA_PLAN.items()}


__all__ = ["hf_tensor_parallel_plan"]
