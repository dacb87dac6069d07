"""TO MERGE INTO ``lightning_dist/_compat.py``: the private torch APIs the telemetry touches.

Kept in its own file only because ``_compat.py`` is being edited concurrently; once merged, ``telemetry/comm.py``
imports these names from ``lightning_dist._compat`` and this file goes away.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def functional_collectives_module() -> ModuleType:
    """``torch.distributed._functional_collectives`` (private): the module DTensor calls as ``funcol.<name>``.

    DTensor's placements and redistribute look the functions up on this module at call time
    (``funcol.all_reduce``, ``funcol.all_gather_single``, ``funcol.reduce_scatter_single`` in torch 2.13;
    ``funcol.all_gather_tensor`` / ``funcol.reduce_scatter_tensor`` before), so the communication tracker replaces
    those module attributes while it is installed.
    """
    import torch.distributed._functional_collectives as funcol

    return funcol


def wait_functional_collective(tensor: torch.Tensor) -> torch.Tensor:
    """Block until the functional collective that produced ``tensor`` finished; return the plain result.

    ``AsyncCollectiveTensor.wait()`` and ``funcol.wait_tensor`` are both in the private module. On CPU this blocks the
    host; on CUDA it makes the current stream wait for the collective's stream.
    """
    import torch.distributed._functional_collectives as funcol

    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return funcol.wait_tensor(tensor)


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (``c10d._resolve_process_group``, private).

    Functional collectives identify groups by name (a DeviceMesh axis passes ``mesh._dim_group_names[dim]``); the
    tracker maps the names of the mesh axes it knows directly and needs this only for a group it has not seen.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)
