"""LightningDataModule that shards data by data-parallel rank only."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from lightning_dist import _compat
from lightning_dist.contract import data_parallel_kwargs, strategy_view
from lightning_dist.data import corpus
from lightning_dist.data.config import (
    DataConfig,
    data_seed,
    per_rank_batch_size,
    sources,
    validate_data_config,
)
from lightning_dist.data.files import TextDataset, TokenDataset
from lightning_dist.data.packed import PackedDataset, build_cache, hf_datasets
from lightning_dist.data.sources import parse_source
from lightning_dist.data.streaming import StreamedWindows, build_streamed_windows, merge_states
from lightning_dist.data.synthetic import MarkovChain, SyntheticDataset
from lightning_dist.data.token_norm import GlobalBatchTokensSampler

_BYTE_VOCAB = 256


class TokenDataModule(pl.LightningDataModule):
    """Serves ``(inputs, targets)`` LongTensor batches for next-token prediction.

    Sharding uses the data-parallel coordinate only (``trainer.strategy.distributed_sampler_kwargs``), so
    tensor/pipeline-parallel peers that share it receive identical batches. The Trainer must be built with
    ``use_distributed_sampler=False``; this module builds its own ``DistributedSampler``. Lightning's fit loop
    calls ``set_epoch`` on the train dataloader's sampler at the start of every epoch
    (``_set_sampler_epoch`` in ``FitLoop.on_advance_start``), which reshuffles each epoch.

    DP equivalence: with the same seed, the union of the samples the N data-parallel ranks see at optimizer step
    k equals the samples a single process (batch = global_batch_size) sees at step k. All N samplers share one
    permutation ``perm`` of the dataset; rank r takes ``perm[r::N]``, so its k-th batch of ``b = G / N`` items
    holds positions ``k*G + r + N*j`` (j < b), which together are exactly ``perm[k*G:(k+1)*G]``. With drop_last
    on both the sampler and the loader, every N yields ``len // G`` full steps per epoch (the partial tail
    step is dropped), so no truncation of the dataset is needed.

    Masked targets (data=hf ``instruction`` / ``chat``): each training sample comes with ``(G, N_s)``, its global
    batch's samples and target tokens, which the same permutation gives every rank without communication, so the loss
    is the token mean over the global batch under every layout (``token_norm.py``). Each validation sample comes with
    those of its global validation batch (``data.global_batch_size`` consecutive samples of the validation order), so
    val/loss is the mean over global validation batches of their token means, weighted by their samples.
    """

    def __init__(self, cfg: DataConfig, seed: int = 0) -> None:
        """Validates the config; datasets are built lazily in ``setup``.

        Args:
            cfg: Data config (a DataConfig or an equivalent DictConfig).
            seed: The run's seed, used when ``cfg.seed`` is None.
        """
        super().__init__()
        validate_data_config(cfg)
        self.cfg = cfg
        self.seed = data_seed(cfg, seed)
        self._chain: MarkovChain | None = None
        self._datasets: dict[str, Dataset] = {}
        self._resume_step = 0  # optimizer steps already taken by the checkpoint this run resumes from
        self._resume_position: tuple[int, int] | None = None  # (epoch, its samples already trained on) at that step
        self._resume_samples: int | None = None  # samples (windows) trained on before it, since the run's start
        self._align_progress = False  # a resume: Lightning's count of the epoch's batches is set from the position
        self._stream: StreamedWindows | None = None  # data.streaming: the train stream, built with the loader
        self._stream_state: dict[str, Any] | None = None  # data.streaming: the position a resume continues from

    @staticmethod
    def per_rank_batch_size(global_batch_size: int, num_replicas: int) -> int:
        """``global_batch_size // num_replicas``, checked (:func:`lightning_dist.data.config.per_rank_batch_size`)."""
        return per_rank_batch_size(global_batch_size, num_replicas)

    @property
    def chain(self) -> MarkovChain | None:
        """The synthetic Markov chain (built on first use), or None for file data."""
        if self.cfg.kind != "synthetic":
            return None
        if self._chain is None:
            self._chain = MarkovChain(self.cfg.vocab_size, self.cfg.branching, self.seed)
        return self._chain

    @property
    def loss_floor(self) -> float | None:
        """Best achievable next-token cross-entropy in nats (synthetic: the entropy rate), else None."""
        chain = self.chain
        return chain.entropy_rate() if chain is not None else None

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the model must embed (256 for byte-level text, the tokenizer's for data=hf)."""
        if self.cfg.kind == "hf" and self.cfg.streaming:
            return len(corpus.load_tokenizer(self.cfg.tokenizer))
        if self.cfg.kind == "hf":
            return self.dataset("train").vocab_size
        return _BYTE_VOCAB if self.cfg.kind == "text" else int(self.cfg.vocab_size)

    def prepare_data(self) -> None:
        """data=hf: tokenize and cache the corpus if it is not cached yet. Lightning calls this on one process per
        node before ``setup``, so the ranks only open the cache (the app has built it before launching them)."""
        if self.cfg.kind == "hf":
            if not self.cfg.streaming:
                build_cache(self.cfg, "data.path")
            if self.cfg.val_path is not None:
                build_cache(self.cfg, "data.val_path")

    def setup(self, stage: str | None = None) -> None:
        """Builds the train and val datasets once; later calls reuse them."""
        if self._datasets:
            return
        cfg = self.cfg
        if cfg.kind == "synthetic":
            chain = self.chain
            assert chain is not None  # kind checked above; internal invariant
            self._datasets = {
                "train": SyntheticDataset(chain, cfg.num_train_samples, cfg.seq_len, "train", self.seed),
                "val": SyntheticDataset(chain, cfg.num_val_samples, cfg.seq_len, "val", self.seed),
            }
        elif cfg.kind == "text":
            self._datasets = {s: TextDataset(cfg.path, s, cfg.seq_len, cfg.val_fraction) for s in ("train", "val")}
        elif cfg.kind == "hf" and cfg.streaming:
            for path in sources(cfg):  # missing sources fail here, before launch; the stream is built per rank
                source = parse_source(path, "data.path")
                if source.hub is None:  # a hub dataset: looked up before launch (lightning_dist/hub.py)
                    corpus.corpus_files(source.location)
            self._datasets = {"val": _packed(build_cache(cfg, "data.val_path"))} if cfg.val_path else {}
        elif cfg.kind == "hf":
            self._datasets = dict(hf_datasets(cfg))
        else:
            self._datasets = {s: TokenDataset(cfg.path, s, cfg.seq_len, cfg.token_dtype) for s in ("train", "val")}

    def dataset(self, split: str) -> Dataset:
        """Returns the cached dataset of ``split`` ("train" or "val"), building datasets if needed."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is unknown; use 'train' or 'val'")
        self.setup()
        if split not in self._datasets:
            raise ValueError(
                f"data.streaming=true has no {split} dataset to index (train is a stream; val needs data.val_path)"
            )
        return self._datasets[split]

    def check_split_size(self, split: str, num_replicas: int) -> None:
        """The train split must hold one global batch, the val split a sample for each of ``num_replicas``
        data-parallel ranks (checked before launch too: ``config/validate.py``).

        Raises:
            ValueError: One line naming the split, its size and the fix.
        """
        size = len(self.dataset(split))
        if split == "train" and size < self.cfg.global_batch_size:
            raise ValueError(
                f"train split has {size} samples, fewer than data.global_batch_size={self.cfg.global_batch_size}, so "
                "no optimizer step fits; use more data or a smaller batch"
            )
        if split == "val" and size < num_replicas:
            raise ValueError(
                f"val split has {size} samples, fewer than the data-parallel size {num_replicas}; use more "
                "validation data"
            )

    def data_parallel_info(self) -> tuple[int, int]:
        """Returns ``(num_replicas, rank)`` of the data-parallel group; ``(1, 0)`` without a parallel strategy."""
        kwargs = data_parallel_kwargs(self._strategy())
        if not kwargs:
            return 1, 0
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def _strategy(self) -> Any:
        """The attached Trainer's strategy; ``None`` without a Trainer."""
        return self.trainer.strategy if self.trainer is not None else None

    def build_dataloader(self, split: str, num_replicas: int, rank: int) -> DataLoader:
        """Builds the loader of ``split`` for one data-parallel rank.

        Args:
            split: "train" (shuffled, drop_last) or "val" (in order).
            num_replicas: Data-parallel world size.
            rank: This process's data-parallel rank.

        Returns:
            A DataLoader yielding per-rank batches of ``global_batch_size // num_replicas`` samples, or micro batches
            of them under gradient accumulation (:meth:`loader_batch_size`).
        """
        if not 0 <= rank < num_replicas:
            raise ValueError(f"data-parallel rank {rank} is outside [0, {num_replicas}); check the strategy's sizes")
        per_rank = self.per_rank_batch_size(self.cfg.global_batch_size, num_replicas)
        batch_size = self.loader_batch_size(per_rank)
        if split == "train" and self.cfg.kind == "hf" and self.cfg.streaming:
            return self._streamed_loader(num_replicas, rank, per_rank, batch_size)
        dataset = self.dataset(split)
        train = split == "train"
        self.check_split_size(split, num_replicas)
        # drop_last on the sampler keeps every rank at the same number of samples (no padded duplicates).
        sampler: Sampler = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=train, seed=self.seed, drop_last=True
        )
        counts = dataset.target_counts() if isinstance(dataset, PackedDataset) else None  # None: every target counts
        if train:
            epoch, offset = self.position_at(self._resume_step)
            sampler = StepSampler(sampler, per_rank, counts, epoch, offset)
            if self._align_progress and self.trainer is not None:  # once, on the loader built after the restore
                self._align_progress = False
                batches, accumulate = len(sampler) // batch_size, per_rank // batch_size
                left = (
                    sampler.steps_left * accumulate if sampler.offset else 0
                )  # at an epoch's start: the last one done
                _compat.set_epoch_batches_done(self.trainer, batches - left)
        elif counts is not None:
            sampler = GlobalBatchTokensSampler(sampler, counts, self.cfg.global_batch_size)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=train,
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.num_workers > 0,
        )

    def loader_batch_size(self, per_rank: int) -> int:
        """Samples per loader batch: the per-rank batch, split over the Trainer's gradient-accumulation steps.

        Raises:
            ValueError: ``data.micro_batch_size`` and the Trainer's ``accumulate_grad_batches`` disagree, which
                would silently train on a different global batch.
        """
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
        micro = self.cfg.micro_batch_size
        if per_rank % accumulate:
            raise ValueError(
                f"accumulate_grad_batches={accumulate} does not divide the per-rank batch {per_rank}; use a divisor "
                "of it (or set data.micro_batch_size)."
            )
        batch_size = per_rank // accumulate
        # Under pipeline parallelism the loader serves whole per-rank batches; the schedule cuts the micro batches.
        view = strategy_view(self._strategy())
        pipelined = view is not None and view.pipeline is not None
        if micro is not None and micro != batch_size and not (pipelined and accumulate == 1):
            raise ValueError(
                f"data.micro_batch_size={micro} but the Trainer accumulates {accumulate} batch(es) of the per-rank "
                f"batch {per_rank}; set accumulate_grad_batches={per_rank // micro} (the app does this for you)."
            )
        return batch_size

    def _streamed_loader(self, num_replicas: int, rank: int, per_rank: int, batch_size: int) -> DataLoader:
        """data.streaming: this rank's share of the stream, continued from the checkpoint's position on resume."""
        # The states of the last boundaries are kept for state_dict: more than the loader and the fit loop read ahead.
        self._stream = build_streamed_windows(self.cfg, rank, num_replicas, kept=4 * per_rank)
        if self._stream_state is not None:
            self._stream.load_state_dict(self._stream_state)
        return DataLoader(self._stream, batch_size=batch_size, drop_last=True, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: how far into the data training got, in samples (windows), whatever the
        global batch was: ``samples`` since the run's start, and ``epoch`` with ``epoch_samples`` (the samples of that
        epoch's order already trained on) or, for ``data.streaming``, the stream's position before the first window
        not yet trained on (not the loader's, which reads ahead). A resume with another ``data.global_batch_size``
        (``resume_allow_changes=true``) continues from there: no sample skipped or read twice."""
        step = int(self.trainer.global_step) if self.trainer is not None else 0
        state: dict[str, Any] = {"global_step": step, "samples": self.samples_at(step)}
        if self._stream is not None:  # the windows consumed, the same on every rank
            state["stream"] = _whole_position(self._stream, state["samples"])
        elif self._stream_state is not None:  # resumed, and no batch read since
            state["stream"] = self._stream_state
        elif not (self.cfg.kind == "hf" and self.cfg.streaming):
            state["epoch"], state["epoch_samples"] = self.position_at(step)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """On resume, continue the interrupted epoch (or the stream) where it stopped instead of replaying it."""
        self._resume_step = int(state_dict.get("global_step", 0))
        self._stream_state = state_dict.get("stream")
        self._resume_samples = state_dict.get("samples")
        if "epoch" in state_dict:  # else a checkpoint from before positions were saved in samples: by its step
            self._resume_position = (int(state_dict["epoch"]), int(state_dict["epoch_samples"]))
        self._align_progress = True
        if self.cfg.kind == "hf" and self.cfg.streaming and self._resume_step and self._stream_state is None:
            raise ValueError(
                f"the checkpoint (step {self._resume_step}) holds no stream position: it was not saved with "
                "data.streaming=true; resume with the data config it was saved with"
            )

    def samples_at(self, step: int) -> int:
        """Samples (``data.streaming``: windows) trained on before optimizer step ``step``, since the run's start:
        those of the checkpoint resumed from, then ``data.global_batch_size`` per step."""
        if self._resume_samples is not None:
            base = int(self._resume_samples)
        elif self._stream_state is not None:  # a stream's checkpoint from before samples were saved
            base = int(self._stream_state.get("window", self._resume_step * self.cfg.global_batch_size))
        else:
            base = self._resume_step * self.cfg.global_batch_size
        return base + (step - self._resume_step) * self.cfg.global_batch_size

    def position_at(self, step: int) -> tuple[int, int]:
        """``(epoch, samples of its order already trained on)`` before optimizer step ``step``: from the checkpoint's
        position (in samples, whatever its batch), the resumed epoch's whole global batches, then whole epochs of
        ``len // data.global_batch_size`` steps (the tail of each epoch's order that fills no global batch is left)."""
        size, batch = len(self.dataset("train")), self.cfg.global_batch_size
        per_epoch = size // batch
        epoch, offset = self._resume_position or (divmod(self._resume_step, per_epoch) if per_epoch else (0, 0))
        if self._resume_position is None:
            offset *= batch  # a checkpoint from before positions were saved in samples: its batch taken as this one
        left = (size - offset) // batch  # whole global batches left in the resumed epoch
        done = step - self._resume_step
        if done < left:
            return epoch, offset + done * batch
        return epoch + 1 + (done - left) // per_epoch, (done - left) % per_epoch * batch

    def train_dataloader(self) -> DataLoader:
        """Returns this data-parallel rank's shuffled train loader."""
        return self.build_dataloader("train", *self.data_parallel_info())

    def val_dataloader(self) -> DataLoader | list:
        """Returns this data-parallel rank's in-order val loader (none: data.streaming=true without data.val_path)."""
        if self.cfg.kind == "hf" and self.cfg.streaming and self.cfg.val_path is None:
            return []  # validation off: Lightning runs no val loop without a loader
        return self.build_dataloader("val", *self.data_parallel_info())


class StepSampler(Sampler[int]):
    """Serves the data stream by global batch: each epoch's order cut into blocks of one global batch, this rank's
    share of each block in turn, resuming mid-epoch at a position in samples.

    Lightning's own epoch counter cannot be trusted for this: a run stopped by ``max_steps`` mid-epoch is saved as
    if the epoch had ended, and a resumed run would start the next permutation. Here the first iteration starts at
    ``start_offset`` samples into epoch ``start_epoch``'s order (what the checkpoint's run already trained on, in
    samples, whatever its global batch was) and every later iteration serves the next full epoch, so a resumed run
    sees exactly the samples an uninterrupted run would, and with another global batch (a resume that changes it) the
    rest of the epoch, none skipped or read twice.

    Each rank reads one permutation of the dataset (``DistributedSampler``'s with one replica: its seed and epoch): the
    global batch ``k`` of an epoch resumed at ``o`` is ``order[o + k G : o + (k + 1) G]``, of which rank ``r`` reads
    every ``N``-th sample from ``r`` (the ``DistributedSampler``'s own share when ``o`` is a multiple of ``G``).

    With ``counts`` (each sample's target tokens: masked data) it yields ``(index, G, N_s)`` instead of ``index``: the
    global batch size and the target tokens of the global batch of step ``s`` that the index belongs to.
    """

    def __init__(
        self,
        sampler: DistributedSampler,
        samples_per_step: int,
        counts: np.ndarray | None = None,
        start_epoch: int = 0,
        start_offset: int = 0,
    ) -> None:
        self.sampler = sampler
        self.samples_per_step, self.counts = samples_per_step, counts
        self.global_batch = samples_per_step * sampler.num_replicas
        self.size = len(sampler.dataset)  # type: ignore[arg-type]
        self.steps_per_epoch = self.size // self.global_batch
        if (self.size - start_offset) // self.global_batch == 0:  # the epoch was done: the next one, from its start
            start_epoch, start_offset = start_epoch + 1, 0
        self.epoch, self.offset = start_epoch, start_offset
        # Whole optimizer steps only: with micro batches the tail could otherwise hold a partial step's batches.
        self.limit = self.steps_per_epoch * samples_per_step

    @property
    def steps_left(self) -> int:
        """Optimizer steps the next iteration serves (the resumed epoch's rest, or a whole epoch)."""
        return (self.size - self.offset) // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        """Ignored on purpose: the epoch follows from the position (see the class docstring)."""

    def __iter__(self):
        offset, blocks, epoch = self.offset, self.steps_left, self.epoch
        self.epoch, self.offset = epoch + 1, 0
        one = DistributedSampler(
            self.sampler.dataset, 1, 0, shuffle=self.sampler.shuffle, seed=self.sampler.seed, drop_last=True
        )
        one.set_epoch(epoch)
        order = np.fromiter(iter(one), dtype=np.int64, count=self.size)
        rank, replicas, batch = self.sampler.rank, self.sampler.num_replicas, self.global_batch
        for k in range(blocks):
            block = order[offset + k * batch : offset + (k + 1) * batch]
            if self.counts is None:
                yield from block[rank::replicas].tolist()
            else:  # the target tokens of this global batch (= optimizer step), known alike on every rank
                tokens = int(self.counts[block].sum())
                for index in block[rank::replicas].tolist():
                    yield index, batch, tokens

    def __len__(self) -> int:
        # The whole epoch, also while the first iteration resumes mid-epoch: Lightning restores how many batches of
        # the epoch were done (its batch progress) and ends the epoch when that count reaches len(loader); a length
        # without the skipped batches ended a resumed epoch that many batches early, on the next epoch's permutation.
        # After a resume the data module sets that count from the position in samples (the batch may have changed).
        return self.limit


def build_datamodule(cfg: DataConfig, seed: int) -> TokenDataModule:
    """Builds the data module for ``cfg``.

    Args:
        cfg: Data config.
        seed: The run's seed (used when ``cfg.seed`` is None).

    Returns:
        A TokenDataModule.
    """
    return TokenDataModule(cfg, seed=seed)


def _whole_position(stream: StreamedWindows, window: int) -> dict[str, Any]:
    """The stream's position before ``window`` with every stream's state: a rank holds those of the streams it reads
    (``data.num_streams`` > 1), so the ranks gather theirs (Lightning asks every rank for the state of a checkpoint it
    saves; the same condition on every rank, so all or none of them gather)."""
    state = stream.state_at(window)
    if len(stream.reads) == stream.num_streams or not torch.distributed.is_initialized():
        return state
    states: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return merge_states(states)


def _packed(folder: Any) -> PackedDataset:
    """All the windows of a data=hf cache folder."""
    return PackedDataset(folder, np.load(folder / "windows.npy"))
