"""The statistics behind ``shardkit order-test`` (``shardkit.ordertest.stats``), checked exactly.

Closed forms are compared with full enumeration of every order of small N (exact equality up to
float rounding), tail probabilities with chi-square and with a large seeded Monte Carlo sample.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from shardkit.ordertest import stats as st


def all_orders(n: int, k: int | None = None) -> np.ndarray:
    """Every k-permutation of 0..n-1 (every row equally likely under a uniform order)."""
    return np.array(list(itertools.permutations(range(n), n if k is None else k)), dtype=np.int64)


@pytest.mark.parametrize("n,bins,k", [(5, 5, 5), (6, 3, 6), (6, 3, 4), (5, 2, 3), (6, 4, 5), (4, 4, 2)])
def test_pair_moments_equal_enumeration(n: int, bins: int, k: int) -> None:
    """Mean and covariance of the adjacent-pair table, exactly as over all n!/(n-k)! orders."""
    rows = all_orders(n, k)
    seq = st.bin_index(rows, n, bins)
    tables = st.pair_table(seq, bins).astype(np.float64)
    mean, cov = st.pair_moments(st.bin_sizes(n, bins), k)
    np.testing.assert_allclose(tables.mean(axis=0), mean, atol=1e-12)
    np.testing.assert_allclose(np.cov(tables.T, bias=True), cov, atol=1e-12)


@pytest.mark.parametrize("n,bins,k", [(6, 3, 6), (6, 2, 4), (7, 3, 7), (5, 5, 5)])
def test_same_bin_pair_moments(n: int, bins: int, k: int) -> None:
    """Mean and variance of the pair table's trace: equal to enumeration and to the full covariance."""
    rows = all_orders(n, k)
    b = st.bin_index(rows, n, bins)
    same = (b[:, 1:] == b[:, :-1]).sum(axis=1)
    mean, var = st.same_bin_pair_moments(st.bin_sizes(n, bins), k)
    assert mean == pytest.approx(same.mean(), abs=1e-12) and var == pytest.approx(same.var(), abs=1e-12)
    _, cov = st.pair_moments(st.bin_sizes(n, bins), k)
    diag = np.eye(bins).reshape(-1).astype(bool)
    assert var == pytest.approx(cov[np.ix_(diag, diag)].sum(), abs=1e-12)


def test_pair_moments_of_a_multiset_with_an_absent_bin() -> None:
    """Joint positions of k < n rows: the sequence of position bins over storage has an 'absent'
    label (n - k of them); the same formula holds for any multiset (checked over all 6!/2!2!2! words)."""
    sizes = np.array([2.0, 2.0, 2.0])
    words = np.array(sorted(set(itertools.permutations([0, 0, 1, 1, 2, 2]))))
    tables = st.pair_table(words, 3).astype(np.float64)
    mean, cov = st.pair_moments(sizes, 6)
    np.testing.assert_allclose(tables.mean(axis=0), mean, atol=1e-12)
    np.testing.assert_allclose(np.cov(tables.T, bias=True), cov, atol=1e-12)


@pytest.mark.parametrize("n,k,rb,cb", [(4, 4, 4, 4), (5, 5, 2, 3), (5, 3, 5, 3), (6, 4, 3, 2)])
def test_item_position_statistic_has_mean_dof(n: int, k: int, rb: int, cb: int) -> None:
    """E[X2 (N-1)/N] = (R-1)(C-1) exactly (averaged over every row): the (N-1)/N scaling is right,
    for permutations and for rows of k < n distinct keys (interaction part), binned or not."""
    rows = all_orders(n, k)
    stats_ = [st.item_position_statistic(st.position_table(r[None, :], n, rb, cb), n, k, 1)[0] for r in rows]
    assert np.mean(stats_) == pytest.approx((rb - 1) * (cb - 1), rel=1e-12)
    # Without the scaling the plain Pearson statistic of permutations has mean N(N-1), not (N-1)^2.
    if k == n and rb == cb == n:
        assert np.mean(stats_) * n / (n - 1) == pytest.approx(n * (n - 1))


def test_inclusion_part_scaling_for_distinct_rows() -> None:
    """Rows of k distinct keys: item-frequency Pearson X2 has mean (N-1)(N-k)/(N-1) = N-k, so the
    battery's scale (N-1)/(N-k) gives mean N-1 = its degrees of freedom."""
    n, k = 6, 2
    rows = all_orders(n, k)
    x2 = [st.pearson(np.bincount(r, minlength=n), np.full(n, k / n))[0] for r in rows]
    assert np.mean(x2) * (n - 1) / (n - k) == pytest.approx(n - 1)


def test_weighted_chi2_sf_equal_weights_is_chi2() -> None:
    w = np.full(30, 1.7)
    for x in (1.0, 40.0, 51.0, 120.0, 400.0):
        assert st.weighted_chi2_sf(x, w) == pytest.approx(stats.chi2.sf(x / 1.7, 30), rel=1e-12)
    assert st.weighted_chi2_sf(0.0, w) == 1.0 and st.weighted_chi2_sf(-1.0, w) == 1.0


def test_weighted_chi2_sf_matches_monte_carlo_in_the_tail() -> None:
    """The pair test's null (N = 8: 55 weights in three groups) against 2e6 seeded draws."""
    _, eig = st.pair_null(st.bin_sizes(8, 8), 8)
    weights, mult = np.unique(np.round(eig, 8), return_counts=True)
    assert weights.size == 3  # sum of 55 weighted chi2(1) = three scaled chi-squares
    rng = np.random.default_rng(2024)
    draws = np.sort(sum(w * rng.chisquare(m, size=2_000_000) for w, m in zip(weights, mult)))
    for q in (0.5, 0.05, 1e-3, 1e-4):
        x = draws[int((1 - q) * draws.size)]
        assert st.weighted_chi2_sf(x, eig) == pytest.approx(q, rel=0.04 if q >= 1e-3 else 0.2)
    # Monotone, in [0, 1], and tiny far out (where two-moment approximations are off by orders).
    xs = np.linspace(1, 400, 60)
    ps = [st.weighted_chi2_sf(x, eig) for x in xs]
    assert all(a >= b for a, b in itertools.pairwise(ps)) and 0 <= ps[-1] < 1e-40


def imhof_sf(x: float, weights: np.ndarray, mult: np.ndarray) -> float:
    """Exact ``P(sum_j w_j chi2(m_j) > x)`` by Imhof's (1961) inversion integral (reference only)."""
    from scipy import integrate

    def integrand(u: float) -> float:
        theta = 0.5 * float((mult * np.arctan(weights * u)).sum()) - 0.5 * x * u
        rho = float(np.prod((1 + (weights * u) ** 2) ** (mult / 4)))
        return math.sin(theta) / (u * rho)

    value, _ = integrate.quad(integrand, 0, np.inf, limit=2000, epsabs=1e-13, epsrel=1e-10)
    return 0.5 + value / math.pi


def test_weighted_chi2_sf_matches_imhof_far_into_the_tail() -> None:
    """Saddlepoint against the exact inversion integral: within 0.5% down to p = 3e-8 (a two-moment
    chi-square approximation is off by 20-35% below p = 1e-5)."""
    _, eig = st.pair_null(st.bin_sizes(8, 8), 8)
    weights, mult = np.unique(np.round(eig, 8), return_counts=True)
    scale, dof = st.satterthwaite(eig)
    for x in (60.0, 88.0, 110.0, 130.0):
        exact = imhof_sf(x, weights, mult.astype(float))
        assert st.weighted_chi2_sf(x, eig) == pytest.approx(exact, rel=0.005), x
    exact = imhof_sf(130.0, weights, mult.astype(float))
    assert abs(stats.chi2.sf(130.0 / scale, dof) / exact - 1) > 0.2  # why the saddlepoint is used


def test_power_inversion() -> None:
    lam = st.noncentrality_for_power(225, 1e-3, 0.8)
    crit = stats.chi2.isf(1e-3, 225)
    assert stats.ncx2.sf(crit, 225, lam) == pytest.approx(0.8, abs=1e-6)
    assert st.epochs_for_power(lam / 10, 225, 1e-3, 0.8) == 10
    assert st.epochs_for_power(0.0, 225, 1e-3, 0.8) is None
    assert st.epochs_for_power(-1.0, 225, 1e-3, 0.8) is None
    e = st.z_epochs_for_power(0.5, 1e-3, 0.8)
    assert e is not None and stats.norm.sf(stats.norm.isf(5e-4) - 0.5 * math.sqrt(e)) >= 0.8
    assert stats.norm.sf(stats.norm.isf(5e-4) - 0.5 * math.sqrt(e - 1)) < 0.8


def test_split_half_noncentrality_is_unbiased_under_the_null() -> None:
    """Noise alone gives ~0 (squaring one noisy mean would give tr(W C)/M > 0)."""
    rng = np.random.default_rng(3)
    rows = np.array([rng.permutation(40) for _ in range(400)])
    mean, _ = st.pair_null(st.bin_sizes(40, 8), 40)
    tables = st.pair_table(st.bin_index(rows, 40, 8), 8)
    live = mean > 0
    w = np.where(live, 1 / np.where(live, mean, 1), 0)
    assert abs(st.split_half_noncentrality(tables, mean, w)) < 0.1


def test_expected_distinct_labels_exact() -> None:
    assert st.expected_distinct_labels(np.array([2, 2]), 2) == pytest.approx(5 / 3, abs=1e-14)
    labels = np.repeat([0, 1, 2], [3, 1, 2])
    brute = np.mean([np.unique(labels[list(s)]).size for s in itertools.combinations(range(6), 3)])
    assert st.expected_distinct_labels(np.bincount(labels), 3) == pytest.approx(brute, abs=1e-14)
    assert st.expected_distinct_labels(np.array([2, 2]), [2, 4]) == pytest.approx((5 / 3 + 2) / 2)
    # Large counts take the log-gamma path and agree with the product path.
    counts = np.array([5000, 3000, 2000] * 400)
    small = st.expected_distinct_labels(counts[:30], 64)
    assert small == pytest.approx(st.expected_distinct_labels(counts[:30], [64]), rel=1e-12)
    assert 0 < st.expected_distinct_labels(counts, 9000) <= 1200
    with pytest.raises(ValueError, match="batch size"):
        st.expected_distinct_labels(np.array([2, 2]), 5)


def test_distinct_per_batch_counts() -> None:
    codes = np.array([[0, 0, 1, 2, 2, 2, 1], [3, 3, 3, 3, 3, 3, 3]])
    # batches of 3: {0,0,1} -> 2, {2,2,2} -> 1, {1} -> 1 ; second row 1, 1, 1
    np.testing.assert_allclose(st.distinct_per_batch(codes, 3), [4 / 3, 1.0])
    assert st.batch_sizes(7, 3) == [3, 3, 1] and st.batch_sizes(6, 3) == [3, 3]


def test_row_spearman_null_variance_is_exact_even_with_ties() -> None:
    """Over every order, rho has mean 0 and variance exactly 1/(k-1), ties (repeats) included."""
    for values in ([0, 1, 2, 3, 4], [0, 0, 1, 1, 2], [0, 0, 0, 1, 1, 1]):
        rows = np.array(sorted(set(itertools.permutations(values))))
        rho = st.row_spearman(rows)
        assert rho.mean() == pytest.approx(0, abs=1e-12)
        assert (rho**2).mean() == pytest.approx(1 / (len(values) - 1), rel=1e-12)
    assert st.row_spearman(np.array([[4, 4, 4]]))[0] != st.row_spearman(np.array([[4, 4, 4]]))[0]  # NaN
    assert st.row_spearman(np.arange(10)[None, :])[0] == pytest.approx(1.0)
