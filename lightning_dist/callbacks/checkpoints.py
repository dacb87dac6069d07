"""Checkpoints during a run, each published only when complete, and weights a new run starts from."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from lightning_dist import _compat
from lightning_dist.callbacks import beat_file
from lightning_dist.checkpoint.folder import LATEST, complete_checkpoints, merge_parts, parts_written, write_part
from lightning_dist.checkpoint.hf_save import HF_FOLDER, save_hf
from lightning_dist.checkpoint.store import RUN_RECORD, remove
from lightning_dist.checkpoint.weights import load_weights
from lightning_dist.contract import strategy_view
from lightning_dist.parallel.guard import guard_of


class InitWeights(pl.Callback):
    """Start a new run from the weights in ``path`` (see :func:`load_weights`), once the layout is applied."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with beat_file.busy(trainer.global_step):
            load_weights(self.path, pl_module)


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

    Under a ``WandbLogger``, rank 0 also notes the W&B run's step at each save in ``wandb.json`` beside the
    checkpoints (see :func:`wandb_step_of`), before the checkpoint is published: a run continuing from it rewinds
    the W&B history there. Lightning logs the saved step's own metrics after this hook, so the note is renewed at
    the next batch's start, once they are logged.

    Args:
        dirpath: The run's checkpoint folder.
        every_n_steps: Save every this many optimizer steps (``None``: not by steps).
        every_n_minutes: Save when this much wall time has passed since the last save (``None``: not by time).
        keep_last: Complete checkpoints to keep (the newest ones).
        run_record: What defines the run (its seed, data, batch, LR schedule), noted in every checkpoint under
            :data:`~lightning_dist.checkpoint.store.RUN_RECORD`: a run continuing from one is checked against it.
        save_hf: Also write the model's HuggingFace weights (or its LoRA adapters) into ``<checkpoint>/hf``, before
            the checkpoint is published (``lightning_dist/checkpoint/hf_save.py``).
    """

    def __init__(
        self,
        dirpath: Path,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        keep_last: int = 2,
        run_record: dict[str, Any] | None = None,
        save_hf: bool = False,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.save_hf = save_hf
        self.every_n_steps, self.every_n_minutes, self.keep_last = every_n_steps, every_n_minutes, keep_last
        self.run_record = run_record
        self.last_path: Path | None = None
        self.blocked_s: list[float] = []  #: how long each save held the training loop
        self.written_s: list[float] = []  #: how long each save took until its files were complete (this rank's)
        self._last_step = -1
        self._last_time = time.monotonic()
        self._pending: tuple[Any, Path, Path] | None = None  # (future, partial folder, final folder)
        self._pending_wandb: dict[str, Any] | None = None  # the W&B step of the save in flight
        self._wandb_late: str | None = None  # the checkpoint whose W&B step is renewed at the next batch start
        self._hasher: ThreadPoolExecutor | None = None  # hashes an async save's files once they are written

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step, self._last_time = trainer.global_step, time.monotonic()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.run_record is not None:
            checkpoint[RUN_RECORD] = self.run_record

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._wandb_late is None:
            return
        name, self._wandb_late = self._wandb_late, None
        record = _wandb_step(trainer)  # now past the rows the saved step logged after on_train_batch_end
        if record is None:
            return
        if self._pending is not None and self._pending[2].name == name and self._pending[0] is not _DONE:
            self._pending_wandb = record  # an async save not yet published: written when it is
        elif (self.dirpath / name).exists():  # published: the note written before is replaced
            _note_wandb_step(self.dirpath, name, record)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a gradient-accumulation micro batch: no optimizer step yet
        if self._pending is not None and trainer.is_global_zero and self._async_save_written(trainer):
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
        """Write, publish and prune; every rank calls it (the save is collective).

        Raises:
            NonFiniteError: The strategy's guard found a non-finite step since its last report (``stop``): nothing
                of it is written (every rank holds the same count, so every rank raises).
        """
        guard = guard_of(trainer.strategy)
        if guard is not None:
            guard.report(trainer.global_step)  # a device-side skip is read before anything after it is written
        self.wait(trainer)  # one write in flight at a time
        started = time.monotonic()
        step = trainer.global_step
        final = self.dirpath / f"step-{step:08d}"
        partial = self.dirpath / f".step-{step:08d}.partial"
        wandb_step = _wandb_step(trainer) if trainer.is_global_zero else None  # what was logged before this save
        self._wandb_late = final.name if wandb_step is not None else None
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            remove(partial)
        trainer.strategy.barrier()
        rank = getattr(trainer, "global_rank", 0)
        with beat_file.busy(step):  # a save may take minutes: the launcher must not take it for a hang
            trainer.save_checkpoint(partial, weights_only=False)  # the whole state (Lightning logs it when unsaid)
            if self.save_hf:  # collective; inside the folder, so it is published (and pruned) with the checkpoint
                save_hf(trainer.lightning_module, partial / HF_FOLDER, dict(trainer.lightning_module.hparams))
            view = strategy_view(trainer.strategy)  # an async save (MeshStrategy(async_save=True)) leaves its future
            future = view.pending_save if view is not None else None
            if future is None:
                _manifest_part(None, partial, rank)  # this rank's files' sizes and CRC-32s, while in the page cache
        if future is not None:
            view.pending_save = None
            future.add_done_callback(lambda _: self.written_s.append(time.monotonic() - started))
            # Hashed in a thread of ours once written, never in a step (zlib.crc32 releases the GIL as it reads).
            hashed = self._manifest_writer().submit(_manifest_part, future, partial, rank)
            self._pending, self._pending_wandb = (hashed, partial, final), wandb_step
        else:
            trainer.strategy.barrier()  # every rank's files are written, and its part of the manifest
            self.written_s.append(time.monotonic() - started)
            if trainer.is_global_zero:
                self._publish_folder(partial, final, wandb_step)
            trainer.strategy.barrier()
            self.last_path = final
        self._last_step, self._last_time = step, time.monotonic()
        self.blocked_s.append(self._last_time - started)
        return final

    def wait(self, trainer: pl.Trainer) -> None:
        """Wait for the write in flight (every rank, its own), then publish it."""
        if self._pending is None:
            return
        with beat_file.busy(trainer.global_step):
            self._pending[0].result()  # raises what the write raised
            trainer.strategy.barrier()
        if trainer.is_global_zero:
            self._publish(trainer)
        self.last_path, self._pending = self._pending[2], None
        trainer.strategy.barrier()

    def _async_save_written(self, trainer: pl.Trainer) -> bool:
        """Rank 0: whether the save in flight is written and hashed on every rank (each rank's manifest part there)."""
        future, partial, _ = self._pending
        if not future.done():
            return False
        if future.exception() is not None:
            return True  # publishing raises it
        return not partial.is_dir() or parts_written(partial, getattr(trainer, "world_size", 1))

    def _manifest_writer(self) -> ThreadPoolExecutor:
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-manifest")
        return self._hasher

    def _publish(self, trainer: pl.Trainer) -> None:
        future, partial, final = self._pending
        future.result()
        self._publish_folder(partial, final, self._pending_wandb)
        self._pending = (_DONE, partial, final)  # the other ranks still wait for their own writes in wait()

    def _publish_folder(self, partial: Path, final: Path, wandb_step: dict[str, Any] | None = None) -> None:
        if partial.exists():  # not yet published
            if partial.is_dir():
                merge_parts(partial)  # the manifest: every rank's files with their sizes and CRC-32s
            if wandb_step is not None:  # before the rename, so a published checkpoint always has its W&B step
                _note_wandb_step(self.dirpath, final.name, wandb_step)
            remove(final)
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
                remove(old)
        self.last_path = final


def _manifest_part(written: Future | None, partial: Path, rank: int) -> None:
    """Once ``written`` (this rank's asynchronous write) is done, this rank's part of the checkpoint's manifest; a
    single file (Lightning's own ``.ckpt``) needs none: its zip archive keeps a CRC-32 per member."""
    if written is not None:
        written.result()  # raises what the write raised
    if partial.is_dir():
        write_part(partial, rank)


WANDB_STEPS = "wandb.json"  #: in a run's checkpoint folder: checkpoint name -> {"run_id", "step"}


def wandb_step_of(checkpoint: Path) -> dict[str, Any] | None:
    """The W&B run and step noted when ``checkpoint`` was saved, or ``None``.

    ``{"run_id": ..., "step": ...}``: ``step`` is the W&B run's ``run.step`` (the ``_step`` of its next row) once
    the steps before the checkpoint were logged: its rows before ``step`` are theirs.
    """
    index = Path(checkpoint).parent / WANDB_STEPS
    try:
        return json.loads(index.read_text()).get(Path(checkpoint).name)
    except (OSError, ValueError):
        return None


def _wandb_step(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The W&B run's id and next step on rank 0, if the trainer logs to a started, enabled W&B run."""
    logger = getattr(trainer, "logger", None)  # a trainer without one (a test's stand-in) logs nowhere
    if not isinstance(logger, WandbLogger):
        return None
    run = _compat.wandb_experiment(logger)  # never starts a run here
    if run is None or run.disabled:
        return None
    try:
        return {"run_id": run.id, "step": int(run.step)}  # a request to wandb's service: no device value is read
    except Exception:  # the note is optional (mode="shared" has no step): a save must not fail for it
        return None


def _note_wandb_step(dirpath: Path, name: str, record: dict[str, Any]) -> None:
    """Add ``name``'s record to ``dirpath``'s ``wandb.json`` (atomic rename); records of pruned checkpoints go."""
    index = dirpath / WANDB_STEPS
    try:
        records = json.loads(index.read_text())
    except (OSError, ValueError):
        records = {}
    kept = {path.name for path in complete_checkpoints(dirpath)}
    records = {key: value for key, value in records.items() if key in kept} | {name: record}
    tmp = dirpath / f".{WANDB_STEPS}.tmp"
    with tmp.open("w") as file:
        json.dump(records, file)
        file.flush()
        os.fsync(file.fileno())  # durable before the checkpoint it describes is published
    tmp.replace(index)


class _Done:
    """A finished future."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def result() -> None:
        return None

    @staticmethod
    def exception() -> None:
        return None


_DONE = _Done()
