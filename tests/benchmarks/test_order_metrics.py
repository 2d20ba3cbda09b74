"""The randomness metrics of ``benchmarks/compare.py`` (``benchmarks/order_metrics.py``).

Statistical checks use fixed seeds and alpha = 1e-3; each one is paired with a biased order the
metric must reject, so none of them can pass by construction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from tests.helpers.order_stats import ALPHA, om


def uniform_orders(n: int, epochs: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([rng.permutation(n) for _ in range(epochs)])


def buffer_shuffle(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """A shuffle buffer over sequential reads (what WebDataset / tf.data do)."""
    out, buf, src = [], [], iter(range(n))
    for k in src:
        buf.append(k)
        if len(buf) >= buffer:
            out.append(buf.pop(int(rng.integers(len(buf)))))
    while buf:
        out.append(buf.pop(int(rng.integers(len(buf)))))
    return np.array(out)


# ---------------------------------------------------------------------------------------------- chi-square
def test_position_table_counts_every_placement() -> None:
    orders = np.array([[2, 0, 1, 3], [0, 1, 2, 3]])
    t = om.position_table(orders, 4)
    assert t.sum() == 8 and (t.sum(axis=0) == 2).all() and (t.sum(axis=1) == 2).all()
    assert t[2, 0] == 1 and t[0, 1] == 1 and t[3, 3] == 2
    binned = om.position_table(orders, 4, item_bins=2, pos_bins=2)
    np.testing.assert_array_equal(binned, [[3, 1], [1, 3]])


def test_rejects_non_permutations_and_bad_bins() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        om.uniformity_chi2(np.array([[0, 0, 1]]), 3)
    with pytest.raises(ValueError, match=r"pos_bins must be in 2\.\.10"):
        om.uniformity_chi2(uniform_orders(10, 5, 0), 10, pos_bins=1)
    # Bins need not divide N: each bin's own size enters the expectation, so the null is unchanged.
    assert om.uniformity_chi2(uniform_orders(10, 50, 0), 10, pos_bins=3).dof == 9 * 2


def test_chi2_null_calibration_is_uniform_over_many_seeds() -> None:
    """Under exact uniform permutations the p-values are Uniform(0, 1) (KS at alpha = 1e-3).

    This is what the (N-1)/N correction buys: without it the statistic's mean is N(N-1) instead of
    (N-1)^2 and the p-values pile up near 0.
    """
    n, epochs = 20, 200
    ps = [om.uniformity_chi2(uniform_orders(n, epochs, seed), n).pvalue for seed in range(150)]
    assert stats.kstest(ps, "uniform").pvalue > ALPHA
    raw_means = []
    for seed in range(150):
        r = om.uniformity_chi2(uniform_orders(n, epochs, 10_000 + seed), n)
        raw_means.append(r.statistic * n / (n - 1))
    # The uncorrected Pearson statistic sits at N(N-1) = 380, not the textbook (N-1)^2 = 361.
    assert abs(np.mean(raw_means) - n * (n - 1)) < abs(np.mean(raw_means) - (n - 1) ** 2)


def test_chi2_binned_dof_and_pass() -> None:
    n, epochs = 200, 500
    r = om.uniformity_chi2(uniform_orders(n, epochs, 7), n, pos_bins=20)
    assert r.dof == 199 * 19
    assert r.epochs == epochs
    assert r.passes(ALPHA)


def test_chi2_rejects_a_buffer_shuffle() -> None:
    n, epochs = 200, 300
    rng = np.random.default_rng(3)
    orders = np.array([buffer_shuffle(n, 67, rng) for _ in range(epochs)])
    assert not om.uniformity_chi2(orders, n, pos_bins=20).passes(ALPHA)


def test_chi2_rejects_a_subtle_bias() -> None:
    """Swap the first two emitted items 30% of the time when item 0 leads: a small local bias."""
    n, epochs = 20, 2000
    rng = np.random.default_rng(11)
    orders = uniform_orders(n, epochs, 12)
    for row in orders:
        if row[0] != 0 and rng.random() < 0.3:
            j = int(np.flatnonzero(row == 0)[0])
            row[0], row[j] = row[j], row[0]
    assert not om.uniformity_chi2(orders, n).passes(ALPHA)


# ---------------------------------------------------------------------------------------------- labels per batch
def test_expected_distinct_labels_exact_small_case() -> None:
    # 2 classes of 2 records, batches of 2: P(both same class) = 2 / C(4, 2) = 1/3 -> E = 2 - 1/3.
    assert om.expected_distinct_labels([2, 2], 2) == pytest.approx(5 / 3, abs=1e-15)
    # Enumerate every 3-subset of [3, 1, 2] labelled records.
    labels = np.repeat([0, 1, 2], [3, 1, 2])
    from itertools import combinations

    subsets = list(combinations(range(labels.size), 3))
    brute = np.mean([np.unique(labels[list(s)]).size for s in subsets])
    assert om.expected_distinct_labels([3, 1, 2], 3) == pytest.approx(brute, abs=1e-12)
    # Mixed batch sizes average the per-batch expectations.
    assert om.expected_distinct_labels([2, 2], [2, 4]) == pytest.approx((5 / 3 + 2) / 2)


def test_distinct_labels_matches_expectation_under_uniform_and_not_under_buffer() -> None:
    n, b, classes = 3000, 64, 10
    labels = np.arange(n) * classes // n  # class-sorted storage, like ImageFolder
    sizes = om.default_batch_sizes(n, b)
    exp = om.expected_distinct_labels(np.bincount(labels), sizes)
    rng = np.random.default_rng(5)
    uni = [om.distinct_labels_per_batch(labels[rng.permutation(n)], sizes) for _ in range(40)]
    se = np.std(uni, ddof=1) / math.sqrt(len(uni))
    assert abs(np.mean(uni) - exp) < 4 * se + 1e-9
    buf = om.distinct_labels_per_batch(labels[buffer_shuffle(n, 1000, rng)], sizes)
    assert buf < exp - 0.3
    with pytest.raises(ValueError, match="add up"):
        om.distinct_labels_per_batch(labels, [64])


# ---------------------------------------------------------------------------------------------- spearman
def test_spearman_storage_order() -> None:
    n = 3000
    rng = np.random.default_rng(9)
    rhos = [om.storage_spearman(rng.permutation(n)) for _ in range(200)]
    sd = om.spearman_null_sd(n)
    assert abs(np.mean(rhos)) < 4 * sd / math.sqrt(200)
    assert np.std(rhos) == pytest.approx(sd, rel=0.25)
    assert om.storage_spearman(np.arange(n)) == pytest.approx(1.0)
    assert om.storage_spearman(buffer_shuffle(n, 1000, rng)) > 0.5


# ---------------------------------------------------------------------------------------------- adjacent pairs
def block_shuffle(n: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """Shuffle whole storage blocks, then inside each block (a shard shuffle)."""
    blocks = rng.permutation(n // block)
    return np.concatenate([rng.permutation(np.arange(b * block, (b + 1) * block)) for b in blocks])


def test_adjacent_pairs_expectation_is_exact() -> None:
    # Every permutation of 4 keys in blocks of 2: the mean count is sum s(s-1)/N = (2 + 2) / 4 = 1.
    from itertools import permutations

    perms = np.array(list(permutations(range(4))))
    b = perms // 2
    assert (b[:, 1:] == b[:, :-1]).sum(axis=1).mean() == pytest.approx(1.0)
    assert om.adjacent_pairs_test(perms, 4, 2).expected == pytest.approx(1.0)
    # Unequal last block: N = 5, blocks {0,1}, {2,3}, {4}.
    assert om.adjacent_pairs_test(uniform_orders(5, 3, 0), 5, 2).expected == pytest.approx(4 / 5)


def test_adjacent_pairs_calibrated_under_uniform() -> None:
    ps = [om.adjacent_pairs_test(uniform_orders(60, 100, 100 + s), 60, 6).pvalue for s in range(150)]
    assert stats.kstest(ps, "uniform").pvalue > ALPHA


def test_block_shuffle_is_nearly_invisible_to_chi2_but_fails_adjacent_pairs() -> None:
    """Why both tests: a shard shuffle gives each item a uniform position, so the chi-square only sees
    a slight over-dispersion (items of a block move together), while it keeps storage neighbours
    together, which the pair test rejects outright."""
    n, epochs, block = 200, 500, 10
    rng = np.random.default_rng(21)
    orders = np.array([block_shuffle(n, 25, rng) for _ in range(epochs)])
    chi = om.uniformity_chi2(orders, n, pos_bins=20)
    assert chi.statistic < chi.dof + 5 * math.sqrt(2 * chi.dof)  # a buffer shuffle is at > 50 sd
    pairs = om.adjacent_pairs_test(orders, n, block)
    assert pairs.pvalue < 1e-12 and pairs.mean > 5 * pairs.expected
    assert om.adjacent_pairs_test(uniform_orders(n, epochs, 22), n, block).passes(ALPHA)
