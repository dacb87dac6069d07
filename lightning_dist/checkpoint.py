"""Sharded checkpoints (``torch.distributed.checkpoint``) for every layout, pipelines included.

Parameter names are always the full model's (pipeline splitting keeps them), and the optimizer state is stored
flattened, one key per parameter (``state.layers.0.w.exp_avg``, ``param_groups.layers.0.w.lr``). Lightning's nested
form has one ``param_groups`` entry per optimizer, which DCP keeps from a single rank; pipeline ranks hold different
parameters, so the others would lose their groups on load (torchtitan flattens too). So every rank saves and loads
exactly its own keys.
"""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_dist import _compat, heartbeat

_OPTIM_STATE_SAVE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
_OPTIM_STATE_LOAD = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened, CPU-offloaded state of ``optimizer`` over ``model``'s parameters, as DCP saves it."""
    return get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_SAVE)


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load the sharded checkpoint folder ``path`` into ``model`` and ``optimizers`` in place, under any layout.

    Every rank asks DCP for exactly the keys its model and optimizers hold (plain tensors of a pipeline stage and
    DTensors of TP / FSDP2 alike), so a rank's stages and shards are filled from whatever layout wrote the files.

    Returns:
        The rest of Lightning's checkpoint (loops, callbacks, LR schedulers, ...), for Lightning to restore.
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_STATE_LOAD)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_STATE_LOAD)
    return torch.load(path / _compat.checkpoint_metadata_file(), weights_only=weights_only)


def weight_sources(path: Path, module: nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """For each tensor of ``state`` (``module``'s, this rank's), the key it is read from in ``path``.

    Raises:
        ValueError: ``path`` lacks a tensor the module needs, or holds it with another shape (one line).
    """
    from lightning_dist.export import hf_source_names, is_hf_folder

    available = _reader(path).read_metadata().state_dict_metadata
    if is_hf_folder(path):
        sources = hf_source_names(module, state, available)
    else:
        sources = {name: f"state_dict.{name}" for name in state}
    for name, source in sources.items():
        shape = tuple(state[name].shape)
        if source not in available:
            raise ValueError(f"init_from={path} has no tensor {source} (for {name}); is it this model's checkpoint?")
        if tuple(available[source].size) != shape:
            raise ValueError(
                f"init_from={path}: {source} has shape {tuple(available[source].size)} there and {shape} here; set "
                "the model config the weights were trained with."
            )
    return sources


def load_weights(path: Path, module: nn.Module) -> None:
    """Fill ``module``'s weights in place from a HuggingFace folder or a checkpoint folder, under any layout.

    Every rank reads only the slices its shards and stages hold (DCP's resharding; ``HuggingFaceStorageReader`` for
    safetensors). The optimizer, schedule and data position are not read: a new run starts from these weights.

    Raises:
        ValueError: See :func:`weight_sources`.
    """
    state = get_model_state_dict(module)
    sources = weight_sources(path, module, state)
    # One DCP read per pass, each source key at most once per pass (a tied head and embedding share one source).
    passes: list[dict[str, Any]] = [{}, {}]
    for name, source in sources.items():
        passes[0 if source not in passes[0] else 1][source] = state[name]
    for targets in passes:  # every rank runs both passes: DCP's planning is collective
        dcp.load(targets, storage_reader=_reader(path))  # a reader is stateful: a new one per load
    set_model_state_dict(module, state)


def _reader(path: Path) -> Any:
    from lightning_dist.export import is_hf_folder

    return dcp.HuggingFaceStorageReader(str(path)) if is_hf_folder(path) else dcp.FileSystemReader(str(path))


class InitWeights(pl.Callback):
    """Start a new run from the weights in ``path`` (see :func:`load_weights`), once the layout is applied."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with heartbeat.busy(trainer.global_step):
            load_weights(self.path, pl_module)


def save_async(strategy: Any, checkpoint: dict[str, Any], path: Path) -> Any:
    """Start writing Lightning's ``checkpoint`` to the folder ``path`` in the background; return the write's future.

    Lightning's sharded layout (the ``state_dict`` / ``optimizer_<i>`` entries through DCP, the rest in one file from
    rank 0). DCP copies the state to host memory before this returns, so training may change the weights at once.
    The background thread's collectives run on a gloo group of their own, never beside the training's on one group.
    The folder is complete when rank 0's future is done (DCP writes ``.metadata`` after every rank's data).
    """
    if getattr(strategy, "_checkpoint_group", None) is None:
        strategy._checkpoint_group = torch.distributed.new_group(backend="gloo")
    path.mkdir(parents=True, exist_ok=True)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    future = dcp.async_save(state, checkpoint_id=path, process_group=strategy._checkpoint_group)
    if strategy.global_rank == 0:
        torch.save(checkpoint, path / _compat.checkpoint_metadata_file())
    return future


# ------------------------------------------------------------------------------------------ during the run
LATEST = "latest"  #: the file naming the newest complete checkpoint of a run's checkpoint folder


class RunCheckpoints(pl.Callback):
    """Checkpoints during the run, each published only once complete, the newest ``keep_last`` kept.

    A checkpoint is written by Lightning's own flow (``trainer.save_checkpoint``: model, optimizer, LR schedule,
    loops, data position) under a temporary name, then renamed to ``step-<N>`` and named in the ``latest`` file
    (written to a temporary file, flushed to disk and renamed: atomic on POSIX). A crash mid-save leaves only a
    ``.partial`` folder and the previous checkpoint still named as latest; older checkpoints are pruned only after a
    newer one is published. Saves happen after an optimizer step: every ``every_n_steps``, once ``every_n_minutes``
    have passed since the last one (rank 0's clock decides for all), and at the end of training.

    With a strategy that saves asynchronously (``MeshStrategy(async_save=True)``) the step waits only for the copy
    to host memory; rank 0 publishes the checkpoint at the first step boundary after its write completed, and every
    rank waits for its own write before the next save and at the end.

    Args:
        dirpath: The run's checkpoint folder.
        every_n_steps: Save every this many optimizer steps (``None``: not by steps).
        every_n_minutes: Save when this much wall time has passed since the last save (``None``: not by time).
        keep_last: Complete checkpoints to keep (the newest ones).
    """

    def __init__(
        self, dirpath: Path, every_n_steps: int | None = None, every_n_minutes: float | None = None, keep_last: int = 2
    ) -> None:
        self.dirpath = Path(dirpath)
        self.every_n_steps, self.every_n_minutes, self.keep_last = every_n_steps, every_n_minutes, keep_last
        self.last_path: Path | None = None
        self.blocked_s: list[float] = []  #: how long each save held the training loop
        self.written_s: list[float] = []  #: how long each save took until its files were complete (this rank's)
        self._last_step = -1
        self._last_time = time.monotonic()
        self._pending: tuple[Any, Path, Path] | None = None  # (future, partial folder, final folder)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step, self._last_time = trainer.global_step, time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a gradient-accumulation micro batch: no optimizer step yet
        if self._pending is not None and trainer.is_global_zero and self._pending[0].done():
            self._publish(trainer)
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self.save(trainer)
        elif self.every_n_minutes is not None:
            due = time.monotonic() - self._last_time >= 60 * self.every_n_minutes
            if trainer.strategy.broadcast(due):  # rank 0's clock decides, so every rank saves at the same step
                self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.save(trainer)
        self.wait(trainer)

    def save(self, trainer: pl.Trainer) -> Path:
        """Write, publish and prune; every rank calls it (the save is collective)."""
        self.wait(trainer)  # one write in flight at a time
        started = time.monotonic()
        step = trainer.global_step
        final = self.dirpath / f"step-{step:08d}"
        partial = self.dirpath / f".step-{step:08d}.partial"
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            _remove(partial)
        trainer.strategy.barrier()
        with heartbeat.busy(step):  # a save may take minutes: the launcher must not take it for a hang
            trainer.save_checkpoint(partial)
        future = getattr(trainer.strategy, "pending_save", None)
        if future is not None:
            trainer.strategy.pending_save = None
            future.add_done_callback(lambda _: self.written_s.append(time.monotonic() - started))
            self._pending = (future, partial, final)
        else:
            trainer.strategy.barrier()  # every rank's files are written
            self.written_s.append(time.monotonic() - started)
            if trainer.is_global_zero:
                self._publish_folder(partial, final)
            trainer.strategy.barrier()
            self.last_path = final
        self._last_step, self._last_time = step, time.monotonic()
        self.blocked_s.append(self._last_time - started)
        return final

    def wait(self, trainer: pl.Trainer) -> None:
        """Wait for the write in flight (every rank, its own), then publish it."""
        if self._pending is None:
            return
        with heartbeat.busy(trainer.global_step):
            self._pending[0].result()  # raises what the write raised
            trainer.strategy.barrier()
        if trainer.is_global_zero:
            self._publish(trainer)
        self.last_path, self._pending = self._pending[2], None
        trainer.strategy.barrier()

    def _publish(self, trainer: pl.Trainer) -> None:
        future, partial, final = self._pending
        future.result()
        self._publish_folder(partial, final)
        self._pending = (_DONE, partial, final)  # the other ranks still wait for their own writes in wait()

    def _publish_folder(self, partial: Path, final: Path) -> None:
        if partial.exists():  # not yet published
            _remove(final)
            partial.rename(final)
            pointer = self.dirpath / f".{LATEST}.tmp"
            with pointer.open("w") as file:
                file.write(final.name + "\n")
                file.flush()
                os.fsync(file.fileno())  # durable before it names the checkpoint
            pointer.replace(self.dirpath / LATEST)
            directory = os.open(self.dirpath, os.O_RDONLY)
            try:
                os.fsync(directory)  # the renames too
            finally:
                os.close(directory)
            for old in complete_checkpoints(self.dirpath)[: -self.keep_last]:
                _remove(old)
        self.last_path = final


class _Done:
    """A finished future."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def result() -> None:
        return None


_DONE = _Done()


def complete_checkpoints(dirpath: Path) -> list[Path]:
    """The published checkpoints in ``dirpath``, oldest first (``.partial`` ones are unfinished saves)."""
    if not Path(dirpath).is_dir():
        return []
    return sorted(p for p in Path(dirpath).iterdir() if p.name.startswith("step-"))


def latest_checkpoint(dirpath: Path) -> Path | None:
    """The checkpoint the ``latest`` file names, else the newest published one that is whole; ``None`` if none."""
    pointer = Path(dirpath) / LATEST
    if pointer.is_file():
        named = Path(dirpath) / pointer.read_text().strip()
        if named.exists() and damage(named) is None:
            return named
    whole = [path for path in complete_checkpoints(dirpath) if damage(path) is None]
    return whole[-1] if whole else None


def damage(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be loaded (missing parts, a truncated file), or ``None`` if it looks whole.

    A sharded folder is whole once DCP wrote ``.metadata`` (its last step) and Lightning its own file; a single file
    is a zip archive (``torch.save``) whose directory, at its end, is readable.
    """
    path = Path(path)
    if path.is_dir():
        missing = [name for name in (".metadata", _compat.checkpoint_metadata_file()) if not (path / name).is_file()]
        return f"missing {', '.join(missing)}" if missing else None
    if not path.is_file():
        return "no such file or folder"
    return None if zipfile.is_zipfile(path) else "not a complete torch.save archive (truncated?)"


def check_loadable(path: Path) -> None:
    """Raise one line naming ``path``, what is wrong with it and the newest whole checkpoint beside it.

    Raises:
        ValueError: The checkpoint is damaged.
    """
    problem = damage(path)
    if problem is None:
        return
    good = latest_checkpoint(Path(path).parent)
    fallback = f"the newest whole checkpoint there is {good}" if good else "there is no whole checkpoint beside it"
    raise ValueError(f"checkpoint {path} cannot be loaded ({problem}); {fallback}.")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
