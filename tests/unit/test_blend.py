"""Mixtures by index (lightning_dist/data/blend.py): the weights read as exact decimals, every prefix of the blend
within 1 - 1/(2(J-1)) windows of each source's share, exact at every period, the same sequence every time."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_dist.data.blend import Blend


def _worst(blend: Blend, size: int) -> float:
    source, position = blend.index(size)
    shares = np.array(blend.shares) / blend.period
    counts = np.zeros(len(blend.shares))
    worst = 0.0
    for n, j in enumerate(source, start=1):
        assert position[n - 1] == counts[j]  # its place in its source: how many of that source came before
        counts[j] += 1
        worst = max(worst, float(np.abs(counts - shares * n).max()))
    return worst


def test_every_prefix_is_within_the_bound_of_each_share_for_random_weights() -> None:
    rng = random.Random(0)
    for _ in range(300):
        sources = rng.randint(2, 12)
        weights = [rng.choice([0.01, 0.1, 0.25, 1, 3, 7, 50, 2.5]) * rng.randint(1, 9) for _ in range(sources)]
        assert _worst(Blend(weights), 300) <= 1 - 1 / (2 * (sources - 1)) + 1e-12, weights


def test_megatron_s_rule_would_not_keep_the_bound() -> None:
    """The rule the bound rests on: the source furthest behind its share (Megatron's) exceeds a window here."""
    weights = [1, 1, 1, 1, 1, 1, 1, 1, 50, 50]
    counts, worst = [0] * len(weights), 0.0
    shares = np.array(weights) / sum(weights)
    for n in range(1, 200):
        j = int(np.argmax(shares * max(n - 1, 1) - np.array(counts)))
        counts[j] += 1
        worst = max(worst, float(np.abs(np.array(counts) - shares * n).max()))
    assert worst > 1 - 1 / (2 * (len(weights) - 1))
    assert _worst(Blend(weights), 200) <= 1 - 1 / (2 * (len(weights) - 1))


def test_weights_are_exact_decimals_and_the_blend_repeats_with_their_period() -> None:
    blend = Blend([0.2, 0.3, 0.5])
    assert blend.shares == [2, 3, 5] and blend.period == 10
    assert Blend([1, 3]).shares == [1, 3] and Blend([0.1, 0.2]).shares == [1, 2]  # not 0.30000000000000004
    source, _ = blend.index(1000)
    np.testing.assert_array_equal(source[:10], source[10:20])
    assert blend.counts(1000) == [200, 300, 500]
    assert blend.counts(1003) == np.bincount(blend.index(1003)[0], minlength=3).tolist() == [200, 301, 502]
    assert Blend([5]).index(4)[0].tolist() == [0, 0, 0, 0]
    for n in (1, 7, 23):
        assert Blend([0.2, 0.3, 0.5]).index(n)[0].tolist() == source[:n].tolist()  # the same sequence every time


@pytest.mark.parametrize("weights", [[], [1, 0], [1, -2], [float("nan")], [float("inf"), 1], [True]])
def test_weights_that_are_not_positive_numbers_are_one_line(weights: list) -> None:
    with pytest.raises(ValueError, match=r"^data.weights=.*: give one positive weight per source.$"):
        Blend(weights, "data.weights")
