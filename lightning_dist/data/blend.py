"""Mixtures by index: which source each window of a blend comes from, by weight, deterministically, without copies.

A blend of ``J`` sources with weights ``w_j`` is a sequence: window ``n`` of the blend is the next window of source
``source[n]``, and each source is read once, in its own order (Megatron's ``BlendedDataset`` has the same structure:
a dataset index and a sample index per sample). The weights are read as exact fractions of their decimal form
(``0.2`` is 1/5, ``[1, 3]`` is 1/4 and 3/4), normalized to integers ``a_j`` over their sum ``P``.

**The rule** is Tijdeman's solution of the chairman assignment problem: window ``n`` goes, among the sources at
least ``1/(2(J-1))`` of a window behind their share ``w_j * n``, to the one whose next window is due soonest. So
**among the first n windows of the blend, source j has within 1 - 1/(2(J-1)) windows of w_j * n, for every n** (two
sources: within 1/2; three: within 3/4; always under one window), and exactly ``a_j * n / P`` at every multiple of
``P`` (the sequence repeats with period ``P``: 10 for 0.2 / 0.3 / 0.5). Megatron's rule (the source furthest below its
share) reaches 1.17 windows with many sources. Every window holds ``seq_len + 1`` tokens, so the token counts follow
the window counts exactly. Integer arithmetic only: the same sequence on every machine.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


class Blend:
    """The sources' integer shares and the rule that picks the source of each window.

    Args:
        weights: One positive weight per source (normalized; a float is read as its shortest decimal form).
        where: The config field or option that gave them, for errors.

    Raises:
        ValueError: A weight that is not a positive finite number (one line, naming ``where``).
    """

    def __init__(self, weights: Sequence[float], where: str = "weights") -> None:
        if not weights or any(not _positive(w) for w in weights):
            raise ValueError(f"{where}={list(weights)}: give one positive weight per source.")
        fractions = [Fraction(str(w)) if isinstance(w, float) else Fraction(w) for w in map(_exact, weights)]
        scale = math.lcm(*(f.denominator for f in fractions))
        shares = [int(f * scale) for f in fractions]
        common = math.gcd(*shares)
        #: Each source's integer share; the period ``P`` is their sum.
        self.shares: list[int] = [s // common for s in shares]
        self.period: int = sum(self.shares)

    @property
    def weights(self) -> list[float]:
        """The normalized weights."""
        return [s / self.period for s in self.shares]

    def next_source(self, counts: Sequence[int]) -> int:
        """The source of the next window, given each source's windows so far (module docstring)."""
        if len(self.shares) == 1:
            return 0
        n, margin = sum(counts) + 1, 2 * (len(self.shares) - 1)
        best, due = -1, (0, 1)
        for j, (share, count) in enumerate(zip(self.shares, counts)):
            if margin * (share * n - self.period * count) < self.period:
                continue  # less than 1/(2(J-1)) of a window behind its share: not a candidate
            # When its next window is due: ((1 - 1/margin) + count) / w_j, compared as a fraction (times P / margin).
            numerator = margin - 1 + margin * count
            if best < 0 or numerator * due[1] < due[0] * share:
                best, due = j, (numerator, share)
        return best

    def index(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``size`` windows of the blend: each one's source, and its position in that source (how many of
        that source's windows come before it). One period is computed and repeated."""
        steps = min(size, self.period)
        counts = [0] * len(self.shares)
        period = np.empty(steps, dtype=np.int64)
        for n in range(steps):
            j = self.next_source(counts)
            period[n] = j
            counts[j] += 1
        source = np.tile(period, -(-size // max(steps, 1)))[:size]
        position = np.empty(size, dtype=np.int64)
        for j in range(len(self.shares)):
            mask = source == j
            position[mask] = np.arange(int(mask.sum()), dtype=np.int64)
        return source, position

    def counts(self, size: int) -> list[int]:
        """How many of the first ``size`` windows each source gives (whole periods, then the rest's prefix)."""
        periods, rest = divmod(size, self.period)
        source, _ = self.index(rest)
        tail = np.bincount(source, minlength=len(self.shares)).tolist()
        return [periods * share + extra for share, extra in zip(self.shares, tail)]


def _positive(weight: object) -> bool:
    return isinstance(weight, numbers.Real) and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0


def _exact(weight: numbers.Real) -> int | float | Fraction:
    """A weight as a Python number (numpy's and OmegaConf's as theirs)."""
    return weight if isinstance(weight, (int, Fraction)) else float(weight)
