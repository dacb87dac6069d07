"""Token-exact loss normalization for masked targets (data=hf ``instruction`` / ``chat``), with no communication.

With targets masked to ``-100`` the samples of a batch hold different numbers of loss tokens, so a mean over each micro
batch's own tokens, averaged over micro batches (Lightning's accumulation, the pipeline's microbatches, DDP / FSDP2
over data-parallel ranks), depends on how the global batch was split (HuggingFace Trainer's gradient-accumulation
bug). The loss of optimizer step ``s`` is instead the token mean over its whole global batch: ``sum(ce) / N_s``, with
``N_s`` the global batch's target tokens (what torchtitan and HF's ``num_items_in_batch`` do).

``N_s`` needs no collective: every data-parallel rank's ``DistributedSampler`` slices one permutation ``order`` of the
dataset (rank ``r`` reads ``order[r::dp]``), which every rank computes alike (:func:`global_order`), and the samples of
step ``s`` are its contiguous block ``order[s*G:(s+1)*G]`` (G = the global batch; see ``TokenDataModule``). So the
samplers (``StepSampler`` for training, :class:`GlobalBatchTokensSampler` for validation) yield ``(index, G, N_s)``;
:class:`~lightning_dist.data.packed.PackedDataset` returns the sample with the int64 pair ``(G, N_s)`` (integers: a
precision plugin casts a batch's float tensors to bf16), and the loss of a micro batch of ``B`` samples is
``sum(ce) * (G / N_s) / B``, which every averaging path turns into ``sum over the global batch of ce / N_s``
(``lightning_dist/models/loss.py``).

Validation is normalized the same way by global batch (``global_batch`` consecutive samples of the validation order,
the last one shorter), whatever the loader's batch: the sample-weighted mean of the batch losses, which the modules
log, is the mean over the global validation batches of each one's token mean, weighted by their samples. A global
batch is the same samples under every layout (and ``limit_val_batches`` cuts whole ones, unless micro batches make the
loader's batch smaller), so val/loss does not depend on the layout either.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import DistributedSampler, Sampler


def global_order(sampler: DistributedSampler) -> np.ndarray:
    """The order of the dataset that every rank's ``sampler`` slices (``list(sampler) == order[rank::num_replicas]``)
    in its current epoch: that of a one-replica sampler with the same seed, shuffle and epoch, cut to the samples the
    ranks read together (``total_size``; ``drop_last`` leaves out the tail)."""
    one = DistributedSampler(
        sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=True
    )
    one.set_epoch(sampler.epoch)
    order = np.fromiter(iter(one), dtype=np.int64, count=len(one))
    if sampler.total_size > order.size:  # drop_last=False pads by repeating the start, as DistributedSampler does
        order = np.resize(order, sampler.total_size)
    return order[: sampler.total_size]


def batch_tokens(sampler: DistributedSampler, counts: np.ndarray, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(samples, tokens)`` of each global batch of ``sampler``'s current epoch: the consecutive blocks of
    ``global_batch`` samples of :func:`global_order` (the last one shorter when they do not divide it) and their target
    tokens (``counts[i]`` = sample ``i``'s)."""
    order = global_order(sampler)
    starts = np.arange(0, order.size, global_batch)
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tokens = np.add.reduceat(counts[order].astype(np.int64), starts)
    return np.diff(np.append(starts, order.size)), tokens


class GlobalBatchTokensSampler(Sampler[tuple[int, int, int]]):
    """``sampler``'s indices, each as ``(index, G_k, N_k)``: the samples and target tokens of the global batch ``k``
    (``global_batch`` samples, :func:`batch_tokens`) it belongs to, whatever the loader's batch size. For evaluation:
    the token mean of each global batch, layout-independent (the training stream uses ``StepSampler``)."""

    def __init__(self, sampler: DistributedSampler, counts: np.ndarray, global_batch: int) -> None:
        self.sampler = sampler
        self.counts = counts
        self.global_batch = global_batch

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        samples, tokens = (values.tolist() for values in batch_tokens(self.sampler, self.counts, self.global_batch))
        rank, replicas = self.sampler.rank, self.sampler.num_replicas
        for position, index in enumerate(self.sampler):
            k = (rank + replicas * position) // self.global_batch  # position p of rank r is order[r + replicas * p]
            yield index, samples[k], tokens[k]

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler."""
        self.sampler.set_epoch(epoch)
