"""Seeded first-order Markov chain data with a known loss floor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

# Distinct stream ids so train/val samples never reuse the chain-building stream or each other's.
_SPLIT_STREAMS = {"train": 1, "val": 2}


class MarkovChain:
    """A random sparse first-order Markov chain over ``vocab_size`` tokens.

    Each token ``s`` has ``branching`` distinct successors, always including ``(s + 1) % V`` so the chain is
    irreducible (hence has a unique stationary distribution), with Dirichlet(1) transition probabilities.

    Attributes:
        transition: (V, V) float64 row-stochastic transition matrix.
        stationary: (V,) float64 stationary distribution.
        successors: (V, branching) int64 successor ids per token.
        successor_probs: (V, branching) float64 probabilities matching ``successors``.
    """

    def __init__(self, vocab_size: int, branching: int, seed: int) -> None:
        """Builds the chain deterministically from ``seed``.

        Args:
            vocab_size: Alphabet size V (>= 2).
            branching: Successors per token, in [1, V].
            seed: Seed for ``np.random.default_rng``.
        """
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2; pass a larger vocabulary")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching={branching} must be in [1, vocab_size={vocab_size}]; lower branching")
        self.vocab_size = vocab_size
        self.branching = branching
        rng = np.random.default_rng(seed)
        rows = np.arange(vocab_size)
        # Random keys pick a random subset per row; forcing the key of s+1 above 1 guarantees the ring edge.
        keys = rng.random((vocab_size, vocab_size))
        keys[rows, (rows + 1) % vocab_size] = 2.0
        self.successors = np.argsort(-keys, axis=1, kind="stable")[:, :branching].astype(np.int64)
        self.successor_probs = rng.dirichlet(np.ones(branching), size=vocab_size)
        self.transition = np.zeros((vocab_size, vocab_size), dtype=np.float64)
        self.transition[rows[:, None], self.successors] = self.successor_probs
        self.stationary = self._solve_stationary()
        cdf = np.cumsum(self.successor_probs, axis=1)
        cdf[:, -1] = 1.0  # guard against round-off leaving u > cdf[-1]
        self._cdf = cdf
        self._stationary_cdf = np.cumsum(self.stationary)
        self._stationary_cdf[-1] = 1.0

    def _solve_stationary(self) -> np.ndarray:
        # Solving pi (P - I) = 0 with sum(pi) = 1 directly works even for periodic chains, where power iteration
        # would oscillate; irreducibility (the ring edges) makes the solution unique.
        v = self.vocab_size
        a = self.transition.T - np.eye(v)
        a[-1, :] = 1.0
        b = np.zeros(v)
        b[-1] = 1.0
        pi = np.linalg.solve(a, b)
        pi = np.clip(pi, 0.0, None)
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """Returns the entropy rate in nats/token: the next-token cross-entropy floor of a perfect model."""
        p = self.successor_probs
        row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        return float(np.dot(self.stationary, row_entropy))

    def sample(self, num_sequences: int, length: int, seed: int | Sequence[int]) -> np.ndarray:
        """Samples sequences, the first token drawn from the stationary distribution.

        Args:
            num_sequences: Number of independent sequences.
            length: Tokens per sequence.
            seed: Seed (or seed sequence) for ``np.random.default_rng``.

        Returns:
            (num_sequences, length) int64 token ids.
        """
        rng = np.random.default_rng(seed)
        out = np.empty((num_sequences, length), dtype=np.int64)
        if length == 0 or num_sequences == 0:
            return out
        # One uniform draw per token, drawn up front so the stream layout is fixed.
        u = rng.random((length, num_sequences))
        cur = np.minimum(np.searchsorted(self._stationary_cdf, u[0], side="right"), self.vocab_size - 1)
        out[:, 0] = cur
        last = self.branching - 1
        for t in range(1, length):
            # Inverse CDF over the sparse successor lists: O(num_sequences * branching) per position.
            choice = np.minimum((self._cdf[cur] <= u[t][:, None]).sum(axis=1), last)
            cur = self.successors[cur, choice]
            out[:, t] = cur
        return out


class SyntheticDataset(Dataset):
    """Pre-generated Markov chain samples of ``seq_len + 1`` tokens, returned as ``(inputs, targets)``."""

    def __init__(self, chain: MarkovChain, num_samples: int, seq_len: int, split: str, seed: int) -> None:
        """Generates the split's samples.

        Args:
            chain: The Markov chain to sample from.
            num_samples: Number of samples.
            seq_len: Model sequence length; each sample stores ``seq_len + 1`` tokens.
            split: "train" or "val" (selects an independent sample stream).
            seed: Data seed; identical seeds give identical samples on every machine.
        """
        if split not in _SPLIT_STREAMS:
            raise ValueError(f"split={split!r} is unknown; use 'train' or 'val'")
        self.split = split
        self.seq_len = seq_len
        tokens = chain.sample(num_samples, seq_len + 1, seed=[seed, _SPLIT_STREAMS[split]])
        self.tokens = torch.from_numpy(tokens)

    def __len__(self) -> int:
        """Returns the number of samples."""
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(inputs, targets)`` int64 tensors of length ``seq_len``, targets shifted by one."""
        row = self.tokens[index]
        return row[:-1], row[1:]
