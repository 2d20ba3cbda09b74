"""Reservoir primitives (OneAccess Theorems 1-3) for Vitter's R and Li's L.

Every test is a chi-square goodness-of-fit test at alpha = 1e-3 with a fixed seed; with the trial
counts used, a reservoir that favours early or late items by even a few percent fails.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from shardkit.errors import ConfigError
from shardkit.readers import algorithm_l, algorithm_r, reservoir_keys, sample_of_sample
from tests.helpers.order_stats import ALPHA

ALGORITHMS = {"R": algorithm_r, "L": algorithm_l}


def _subset_chi2(counts: Counter, universe: int, m: int, trials: int) -> float:
    subsets = list(itertools.combinations(range(universe), m))
    observed = np.array([counts.get(s, 0) for s in subsets], dtype=float)
    assert observed.sum() == trials  # no subset outside the universe, no wrong sizes
    return float(stats.chisquare(observed).pvalue)


@pytest.mark.parametrize("name", ["R", "L"])
@pytest.mark.parametrize("as_iterator", [False, True])
def test_theorem1_inclusion_probability(name: str, as_iterator: bool) -> None:
    """Each item is included with probability m/N."""
    fn = ALGORITHMS[name]
    n, m, trials = 12, 4, 12000
    rng = np.random.default_rng(1)
    counts = np.zeros(n)
    for _ in range(trials):
        items = iter(range(n)) if as_iterator else range(n)
        sample = fn(items, m, rng)
        assert len(set(sample.tolist())) == m
        counts[sample] += 1
    p = m / n
    # Inclusion indicators of one sample are negatively correlated; the Pearson statistic is then
    # (1 - p) * N / (N - 1) times a chi-square with N - 1 dof.
    stat = ((counts - trials * p) ** 2 / (trials * p)).sum() / ((1 - p) * n / (n - 1))
    assert stats.chi2.sf(stat, n - 1) > ALPHA


@pytest.mark.parametrize("name", ["R", "L"])
def test_theorem2_every_subset_equally_likely(name: str) -> None:
    fn = ALGORITHMS[name]
    n, m, trials = 7, 3, 14000  # 35 subsets, 400 expected each
    rng = np.random.default_rng(2)
    counts = Counter(tuple(sorted(fn(range(n), m, rng).tolist())) for _ in range(trials))
    assert _subset_chi2(counts, n, m, trials) > ALPHA


@pytest.mark.parametrize("outer,inner", [("R", "L"), ("L", "L"), ("L", "R")])
def test_theorem3_sample_of_sample(outer: str, inner: str) -> None:
    """A uniform m-subset of a uniform k-subset is a uniform m-subset of the source."""
    n, k, m, trials = 8, 5, 2, 14000  # 28 subsets, 500 expected each
    rng = np.random.default_rng(3)
    counts: Counter = Counter()
    for _ in range(trials):
        big = ALGORITHMS[outer](range(n), k, rng)
        small = sample_of_sample(big, m, rng) if inner == "L" else algorithm_r(big, m, rng)
        counts[tuple(sorted(small.tolist()))] += 1
    assert _subset_chi2(counts, n, m, trials) > ALPHA


def test_short_stream_and_edge_sizes() -> None:
    rng = np.random.default_rng(0)
    for fn in ALGORITHMS.values():
        assert sorted(fn(range(3), 5, rng).tolist()) == [0, 1, 2]
        assert sorted(fn(iter(range(3)), 5, rng).tolist()) == [0, 1, 2]
        assert fn(range(3), 0, rng).size == 0
        with pytest.raises(ConfigError):
            fn(range(3), -1, rng)


def test_reservoir_keys_order_is_uniform() -> None:
    """Replacement-mode reservoirs are emitted in uniformly random order: all 3! orders of a
    3-subset of range(3) (= the whole set) are equally frequent."""
    rng = np.random.default_rng(4)
    trials = 6000
    counts = Counter(tuple(reservoir_keys(3, 3, rng).tolist()) for _ in range(trials))
    observed = np.array([counts.get(p, 0) for p in itertools.permutations(range(3))], dtype=float)
    assert observed.sum() == trials
    assert stats.chisquare(observed).pvalue > ALPHA
