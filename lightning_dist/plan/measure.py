"""What one rank's forward keeps for its backward, measured on real tensors: the check of the planner's activations.

:func:`measure_activations` runs in a rank of a launched job (gloo on CPU): it builds the model, lays it out
through the strategies' own path (:func:`~lightning_dist.parallel.lay_out.lay_out`: TP, context parallelism,
activation checkpointing, FSDP2), and runs one micro batch through the step's own forward and backward
(:func:`~lightning_dist.parallel.step.forward_backward`: this cp rank's part of it), its forward under saved-tensor
hooks (:class:`SavedBytes`), which count every tensor autograd keeps for the backward (by storage: a view keeps all
of its base alive). Parameters (FSDP2's gathered ones included) are not activations and are left out.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_dist import _compat, contract
from lightning_dist.config.build import build_module
from lightning_dist.config.schema import TrainConfig
from lightning_dist.config.validate import build_parallel_dims
from lightning_dist.parallel import step
from lightning_dist.parallel.data import param_dtype_of
from lightning_dist.parallel.lay_out import lay_out


class SavedBytes:
    """Saved-tensor hooks counting the bytes of distinct storages autograd keeps inside the ``with`` block."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if not _is_parameter(tensor, storage.data_ptr()):
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class PeakBytes:
    """The peak bytes of tensor storages created inside the ``with`` block and alive at once (a dispatch mode sees
    every op's outputs; a weak reference to each storage sees it freed). What existed before (parameters, inputs)
    is not counted. CPU or CUDA, real tensors; unlike torch's ``MemTracker`` it follows no modules, so a module
    called several times in one forward (the chunked loss's head) is fine."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        mode_base = _compat.torch_dispatch_mode()
        tracker = self

        class _Mode(mode_base):  # type: ignore[misc, valid-type]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for tensor in out if isinstance(out, (tuple, list)) else (out,):  # aten ops: a tensor or a flat tuple
                    if isinstance(tensor, torch.Tensor):
                        tracker.add(tensor.untyped_storage())
                return out

        self._mode = _Mode()

    def add(self, storage: Any) -> None:
        """Count ``storage`` as alive until it is freed (once, however many tensors view it)."""
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __enter__(self) -> PeakBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _is_parameter(tensor: torch.Tensor, pointer: int) -> bool:
    """A parameter, or a view of one (a weight transposed for its matmul): its storage is a leaf's that autograd
    accumulates a gradient into."""
    if tensor.requires_grad and tensor.is_leaf:
        return True
    nodes = tensor.grad_fn.next_functions if tensor.grad_fn is not None else ()
    leaves = [node.variable for node, _ in nodes if node is not None and hasattr(node, "variable")]
    return any(leaf.untyped_storage().data_ptr() == pointer for leaf in leaves)


def measure_activations(cfg: TrainConfig, seed: int = 0) -> dict[str, int]:
    """Bytes this rank's forward of one micro batch keeps for the backward under ``cfg``'s layout.

    Call it in every rank of a job of ``cfg``'s world size (e.g. ``launch(measure_activations, world, cfg)``); it
    starts and ends the gloo process group itself. Returns ``{"saved_bytes", "tokens"}`` (``tokens``: this rank's
    tokens of the micro batch, after the cp split). The backward runs too, so a layout that cannot train fails here.
    """
    dist.init_process_group("gloo")
    try:
        dims = build_parallel_dims(cfg)
        mesh = dims.build_mesh("cpu")
        module = build_module(cfg)
        _compat.set_device_mesh(None, module, mesh)
        torch.manual_seed(seed)
        module.configure_model()
        precision = cfg.cluster.precision
        declared = contract.declared(module, dims, cfg.parallelism)
        rank, device = dist.get_rank(), torch.device("cpu")
        lay_out(
            module, dims, cfg.parallelism, declared, rank=rank, device=device, param_dtype=param_dtype_of(precision)
        )
        micro = cfg.data.micro_batch_size or 1
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len + 1), generator=generator)
        batch = (tokens[:, :-1], tokens[:, 1:])
        saved = SavedBytes()
        autocast = MixedPrecision("bf16-mixed", "cpu").forward_context if precision == "bf16-mixed" else nullcontext

        @contextmanager
        def forward_context() -> Iterator[None]:  # what the forward keeps, under the run's autocast
            with saved, autocast():
                yield

        step.forward_backward(module.compute_loss, batch, dims, cfg.parallelism, forward_context=forward_context)
        return {"saved_bytes": saved.bytes, "tokens": step.local_batch(batch, dims)[0].numel()}
    finally:
        dist.destroy_process_group()


def with_layout(cfg: TrainConfig, **degrees: int) -> TrainConfig:
    """``cfg`` with other parallelism degrees (e.g. ``cp=2, dp_shard=1``)."""
    return replace(cfg, parallelism=replace(cfg.parallelism, **degrees))
