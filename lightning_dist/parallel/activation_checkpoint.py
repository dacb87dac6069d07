"""Activation checkpointing: keep fewer activations for backward and recompute the rest, block by block.

Modes (``activation_checkpointing.mode``):

- ``none``: keep everything.
- ``full``: every block keeps only its inputs and recomputes its forward during backward.
- ``selective``: ``selective="op"`` keeps the outputs of matmuls and attention (the expensive ops) in every block and
  recomputes the cheap ones (norms, activations, element-wise); ``selective="op_half"`` also recomputes every second
  matmul of a block, torchtitan's op-level policy (about 40% less activation memory than ``op`` for a Llama block,
  for a third of its forward matmuls again); ``selective="<n>"`` checkpoints every n-th block fully and keeps the
  others whole.

A block's ``forward`` is replaced on the instance by a checkpointed call of the original, so module and parameter
names do not change (plans, checkpoints and pipeline splits keep working). Applied after tensor parallelism (the
recomputation re-runs the sharded layers) and before FSDP2 (whose hooks stay outside the checkpointed region, so
parameters are all-gathered again for the recomputation). No Lightning, no model code here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_dist.parallel.ac_modes import OP_POLICY_NAMES
from lightning_dist.parallel.options import ActivationCheckpointOptions

#: Ops whose outputs selective (op-level) checkpointing keeps: the matmuls and attention kernels.
_SAVED_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def apply_activation_checkpointing(blocks: Sequence[nn.Module], options: ActivationCheckpointOptions) -> None:
    """Checkpoint ``blocks`` (in execution order) in place as ``options`` say (see the module docstring)."""
    mode, selective = options.mode, options.selective
    if mode == "none":
        return
    if not blocks:
        raise ValueError(
            f"parallelism.activation_checkpointing.mode={mode} needs the model's blocks: define pipeline_spec() on the "
            "module (its blocks_attr names them), or set activation_checkpointing.mode=none."
        )
    for index, block in enumerate(blocks):
        if mode == "full" or (selective not in OP_POLICIES and index % int(selective) == 0):
            _checkpoint_forward(block, context_fn=None)
        elif selective in OP_POLICIES:
            _checkpoint_forward(block, context_fn=OP_POLICIES[selective])


def _keep_matmuls() -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _keep_every_other_matmul() -> Any:
    # One counter pair per checkpointed call (context_fn runs per call): the recomputation sees the same matmuls in
    # the same order as its forward, so both decide alike, whatever other micro batches ran in between.
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


#: ``activation_checkpointing.selective`` values that choose an op-level policy (names: ``ac_modes.OP_POLICY_NAMES``).
OP_POLICIES = dict(zip(OP_POLICY_NAMES, (_keep_matmuls, _keep_every_other_matmul), strict=True))


def _checkpoint_forward(block: nn.Module, context_fn: Any) -> None:
    original = block.forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(original)
    def forward(*args: Any, **inputs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs, **inputs)

    block.forward = forward
