"""Materializing a model built on the meta device: each rank allocates only what it holds, then initializes it.

A model whose module offers ``reset_parameters()`` is built on the meta device under our strategies; after it is
split into stages or sharded (TP / FSDP2), each rank allocates its own part (``to_empty``) and the module's
``reset_parameters()`` gives every parameter its one-process value. The reference GPT draws each parameter whole from
a generator seeded by its name, and a sharded (DTensor) parameter keeps its own slice of that value (implicit
replication: the whole value counts as replicated, so copying it into a shard is a local slice, no communication).
Peak memory per rank is its shards plus one whole parameter at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication

from lightning_dist.parallel.declared import Declared


def materialize(model: nn.Module, device: torch.device, declared: Declared) -> None:
    """Allocate ``model``'s meta parameters on ``device`` and initialize them as one process would.

    Only the module's own ``reset_parameters`` (``declared.reset_parameters``) can do that: re-running each layer's
    initializer on a part of the model would draw other random numbers than one process did.

    Raises:
        ValueError: The model is on the meta device and its module has no ``reset_parameters()``.
    """
    if not any(p.is_meta for p in model.parameters()):
        return  # built for real (in __init__ or configure_model): every part keeps its values
    if declared.reset_parameters is None:
        raise ValueError(
            f"{declared.name}'s model is on the meta device and the module has no reset_parameters(), so its parts "
            "cannot be initialized as one process would; build the model for real (in __init__ or configure_model "
            "without empty_init), or define reset_parameters() giving every parameter its one-process value (e.g. "
            "seeded by parameter name)."
        )
    _to_empty_where_meta(model, device)
    with torch.no_grad(), implicit_replication():
        declared.reset_parameters()


def _to_empty_where_meta(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` the parts that are on the meta device only: what was built for real (a LightningModule's
    torchmetrics states, made in ``__init__``) keeps its values."""
    if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
        module.to_empty(device=device, recurse=False)
    for child in module.children():
        if any(t.is_meta for t in (*child.parameters(), *child.buffers())):
            if all(t.is_meta for t in (*child.parameters(), *child.buffers())):
                child.to_empty(device=device)
            else:
                _to_empty_where_meta(child, device)
