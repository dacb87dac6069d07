"""Every private torch / Lightning API lightning-dist touches, in one place.

When one of these moves in a new release, this is the only file to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    """Flatten ``axes`` of ``mesh`` into one axis ``name`` reachable as ``mesh[name]``.

    ``DeviceMesh._flatten`` is private in torch 2.6-2.13; torchtitan uses the same call for its ``dp`` axis.
    """
    return mesh[axes]._flatten(name)


def disable_inference_mode(trainer) -> None:
    """Run Lightning's validation loops under ``no_grad`` instead of ``inference_mode``.

    DTensor rejects inference tensors; ``Trainer(inference_mode=False)`` does the same for every loop, but a
    strategy cannot change the Trainer's constructor arguments, so it flips the loops' private flag.
    """
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
        loop.inference_mode = False


def materialize_distributed_module(module, device) -> None:
    """Lightning's own materialization of meta-device parameters (used by its ModelParallelStrategy)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers, device) -> None:
    """Lightning's helper that moves optimizer state to ``device``."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)
