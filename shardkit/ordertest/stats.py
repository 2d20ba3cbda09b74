"""Null distributions behind the order battery: binned tables, exact covariances, tail probabilities,
power. Pure functions of numpy arrays; the facts they rest on are proved in docs/design.md §15."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy import optimize as _opt
from scipy import special as _special
from scipy import stats as _stats

__all__ = [
    "bin_index",
    "bin_sizes",
    "position_table",
    "item_position_statistic",
    "pair_table",
    "pair_moments",
    "pair_null",
    "same_bin_pair_moments",
    "pearson",
    "weighted_chi2_sf",
    "satterthwaite",
    "noncentrality_for_power",
    "epochs_for_power",
    "z_epochs_for_power",
    "expected_distinct_labels",
    "distinct_per_batch",
    "batch_sizes",
    "row_spearman",
]


def bin_index(values: np.ndarray, n: int, bins: int) -> np.ndarray:
    """Bin of each value in ``0..n-1`` when ``0..n-1`` is cut into ``bins`` contiguous near-equal bins
    (unequal bins keep the exact nulls: every statistic uses each bin's own size)."""
    return (np.asarray(values, dtype=np.int64) * bins) // n


def bin_sizes(n: int, bins: int) -> np.ndarray:
    """Sizes of the bins of :func:`bin_index` (they differ by at most one)."""
    return np.bincount(bin_index(np.arange(n), n, bins), minlength=bins).astype(np.float64)


def position_table(storage: np.ndarray, n: int, item_bins: int, pos_bins: int) -> np.ndarray:
    """Counts ``[item bin, position bin]`` over all rows of ``storage`` (``[epochs, k]`` storage positions)."""
    rows = np.asarray(storage, dtype=np.int64)
    k = rows.shape[1]
    item = bin_index(rows, n, item_bins)
    pos = bin_index(np.arange(k), k, pos_bins)
    flat = item * pos_bins + pos[None, :]
    return np.bincount(flat.reshape(-1), minlength=item_bins * pos_bins).reshape(item_bins, pos_bins)


def item_position_statistic(table: np.ndarray, n: int, k: int, epochs: int) -> tuple[float, np.ndarray]:
    """Scaled Pearson statistic ``X2 (n-1)/n ~ chi2((R-1)(C-1))`` of an item x position table (item
    bins of sizes ``g`` by position bins of sizes ``h``, rows of ``k`` distinct keys out of ``n``) and its
    standardised residuals; the item-frequency part is left out (proof: docs/design.md §15)."""
    t = np.asarray(table, dtype=np.float64)
    r_bins, c_bins = t.shape
    g, h = bin_sizes(n, r_bins), bin_sizes(k, c_bins)
    e = epochs * np.outer(g, h) / n
    fitted = np.outer(t.sum(axis=1), h / k)
    x2 = float(((t - fitted) ** 2 / e).sum())
    return x2 * (n - 1) / n, (t - e) / np.sqrt(e)


def pair_table(bins_seq: np.ndarray, nbins: int) -> np.ndarray:
    """Per-row tables ``[rows, nbins * nbins]`` of consecutive pairs ``(x[p], x[p+1])`` of each row."""
    seq = np.asarray(bins_seq, dtype=np.int64)
    if seq.ndim == 1:
        seq = seq[None, :]
    rows = seq.shape[0]
    flat = seq[:, :-1] * nbins + seq[:, 1:] + (np.arange(rows, dtype=np.int64) * nbins * nbins)[:, None]
    return np.bincount(flat.reshape(-1), minlength=rows * nbins * nbins).reshape(rows, nbins * nbins)


def _falling(g: np.ndarray, eye: np.ndarray, order: int) -> np.ndarray:
    """``prod_j (g[a_j] - #{i < j: a_i = a_j})`` for every index tuple ``(a_1..a_order)``."""
    r = g.size
    out = np.ones((r,) * order)
    for j in range(order):
        shape = [1] * order
        shape[j] = r
        factor = np.asarray(g).reshape(shape)
        for i in range(j):
            both = [1] * order
            both[i], both[j] = r, r
            factor = factor - eye.reshape(both)
        out = out * factor
    return out


def pair_moments(sizes: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact mean ``[R*R]`` and covariance ``[R*R, R*R]`` of the adjacent-pair table
    ``T[a, b] = #{p < length - 1: x[p] = a, x[p+1] = b}`` of a uniformly random arrangement of ``n =
    sum(sizes)`` elements, ``sizes[a]`` of them labelled ``a``, of which the first ``length`` are seen
    (proof: docs/design.md §15)."""
    g = np.asarray(sizes, dtype=np.float64)
    n, r = float(g.sum()), g.size
    k = int(length)
    eye = np.eye(r)
    ff = [1.0, n, n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3)]
    p2 = _falling(g, eye, 2) / ff[2] if ff[2] > 0 else np.zeros((r, r))
    p3 = _falling(g, eye, 3) / ff[3] if ff[3] > 0 else np.zeros((r,) * 3)
    p4 = _falling(g, eye, 4) / ff[4] if ff[4] > 0 else np.zeros((r,) * 4)
    pairs = max(k - 1, 0)
    mean = pairs * p2
    second = pairs * np.einsum("ac,bd,ab->abcd", eye, eye, p2)
    if k >= 3:
        second += (k - 2) * (np.einsum("bc,abd->abcd", eye, p3) + np.einsum("ad,cab->abcd", eye, p3))
    if k >= 4:
        second += (k - 2) * (k - 3) * p4
    flat = mean.reshape(-1)
    return flat, second.reshape(r * r, r * r) - np.outer(flat, flat)


def same_bin_pair_moments(sizes: np.ndarray, length: int) -> tuple[float, float]:
    """Exact mean and variance of ``#{p: x[p], x[p+1] share a bin}`` (the trace of the pair table of
    :func:`pair_moments`), in O(R)."""
    g = np.asarray(sizes, dtype=np.float64)
    n, k = float(g.sum()), int(length)
    ff = [n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3)]
    f2 = g * (g - 1)
    p2 = float(f2.sum()) / ff[0] if ff[0] > 0 else 0.0
    p3 = float((f2 * (g - 2)).sum()) / ff[1] if ff[1] > 0 else 0.0
    p4 = (float((f2 * (g - 2) * (g - 3)).sum()) + float(f2.sum()) ** 2 - float((f2**2).sum())) / ff[2] if ff[2] > 0 \
        else 0.0
    pairs = max(k - 1, 0)
    second = pairs * p2 + 2 * max(k - 2, 0) * p3 + max(k - 2, 0) * max(k - 3, 0) * p4
    return pairs * p2, second - (pairs * p2) ** 2


@lru_cache(maxsize=64)
def _pair_null_cached(sizes: tuple[float, ...], length: int) -> tuple[np.ndarray, np.ndarray]:
    mean, cov = pair_moments(np.asarray(sizes), length)
    live = mean > 0
    w = 1.0 / np.sqrt(mean[live])
    eig = np.linalg.eigvalsh(w[:, None] * cov[np.ix_(live, live)] * w[None, :])
    eig = eig[eig > 1e-10 * max(float(eig.max()), 1e-300)]
    mean.setflags(write=False)
    eig.setflags(write=False)
    return mean, eig


def pair_null(sizes: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-epoch mean pair table and the eigenvalues ``lambda`` of the Pearson statistic's null
    ``sum lambda_j chi2_1`` over E independent epochs (independent of E; cached)."""
    return _pair_null_cached(tuple(float(x) for x in sizes), int(length))


def pearson(observed: np.ndarray, expected: np.ndarray) -> tuple[float, np.ndarray]:
    """Pearson statistic over the cells with ``expected > 0`` and the standardised residuals."""
    obs = np.asarray(observed, dtype=np.float64)
    exp = np.asarray(expected, dtype=np.float64)
    live = exp > 0
    resid = np.zeros_like(obs)
    resid[live] = (obs[live] - exp[live]) / np.sqrt(exp[live])
    return float((resid[live] ** 2).sum()), resid


def satterthwaite(weights: np.ndarray) -> tuple[float, float]:
    """``(scale, dof)`` of the scaled chi-square with the mean and variance of ``sum w_j chi2_1``."""
    w = np.asarray(weights, dtype=np.float64)
    s1, s2 = float(w.sum()), float((w**2).sum())
    return s2 / s1, s1 * s1 / s2


def weighted_chi2_sf(x: float, weights: np.ndarray) -> float:
    """``P(sum_j w_j chi2_1 > x)`` by the Lugannani-Rice saddlepoint formula (Kuonen 1999), exact for
    equal weights, small relative error far into the tail (docs/design.md §15)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w[w > 0]
    if w.size == 0 or x <= 0:
        return 1.0
    wmax = float(w.max())
    if float(w.min()) >= wmax * (1 - 1e-9):
        return float(_stats.chi2.sf(x / float(w.mean()), w.size))
    mean = float(w.sum())
    scale, dof = satterthwaite(w)
    if abs(x - mean) < 1e-3 * math.sqrt(2 * float((w**2).sum())):
        return float(_stats.chi2.sf(x / scale, dof))
    ratio = w / wmax
    if x > mean:
        # t = -expm1(v) / (2 wmax) with v = log(1 - 2 wmax t) in (-inf, 0): exact near the pole.
        def a_of(v: float) -> np.ndarray:
            return (1.0 - ratio) + ratio * math.exp(v)

        def f_hi(v: float) -> float:
            return float((w / a_of(v)).sum()) - x

        lo = -1.0
        while f_hi(lo) < 0:
            lo *= 2
            if lo < -1400:
                return 0.0
        v = _opt.brentq(f_hi, lo, 0.0, xtol=1e-14)
        t, a = -math.expm1(v) / (2 * wmax), a_of(v)
    else:
        def f_lo(t: float) -> float:
            return float((w / (1 - 2 * w * t)).sum()) - x

        lo_t = -1.0 / wmax
        while f_lo(lo_t) > 0:
            lo_t *= 2
        t = _opt.brentq(f_lo, lo_t, 0.0, xtol=1e-300, rtol=1e-14)
        a = 1 - 2 * w * t
    k0 = -0.5 * float(np.log(a).sum())
    k2 = float((2 * w**2 / a**2).sum())
    r = math.copysign(math.sqrt(max(2 * (t * x - k0), 0.0)), t)
    u = t * math.sqrt(k2)
    if abs(r) < 1e-4 or u == 0:
        return float(_stats.chi2.sf(x / scale, dof))
    p = float(_stats.norm.sf(r) + _stats.norm.pdf(r) * (1 / u - 1 / r))
    return min(max(p, 0.0), 1.0)


def noncentrality_for_power(dof: float, alpha: float, power: float) -> float:
    """Smallest noncentrality ``lam`` with ``P(ncx2(dof, lam) > chi2.isf(alpha, dof)) >= power``."""
    crit = float(_stats.chi2.isf(alpha, dof))

    def f(lam: float) -> float:
        return float(_stats.ncx2.sf(crit, dof, lam)) - power

    hi = 1.0
    while f(hi) < 0:
        hi *= 2
    return float(_opt.brentq(f, 1e-9, hi, xtol=1e-9))


def epochs_for_power(per_epoch: float, dof: float, alpha: float, power: float) -> int | None:
    """Epochs E for which noncentrality ``E * per_epoch`` reaches ``power``; None when it never does.
    A planning figure under the local-alternative approximation (docs/design.md §15)."""
    if not per_epoch > 0 or not math.isfinite(per_epoch):
        return None
    return max(1, math.ceil(noncentrality_for_power(dof, alpha, power) / per_epoch))


def z_epochs_for_power(effect_per_sd: float, alpha: float, power: float) -> int | None:
    """Epochs for a two-sided z-test of a per-epoch mean shift of ``effect_per_sd`` null sds."""
    if not abs(effect_per_sd) > 0 or not math.isfinite(effect_per_sd):
        return None
    z = float(_stats.norm.isf(alpha / 2) + _stats.norm.isf(1 - power))
    return max(1, math.ceil((z / abs(effect_per_sd)) ** 2))


def split_half_noncentrality(tables: np.ndarray, mean: np.ndarray, weight: np.ndarray) -> float:
    """``d_A' diag(weight) d_B``: the per-epoch noncentrality of an alternative from ``[M, cells]``
    ``tables``, ``d_A``, ``d_B`` the deviations of the two halves' means from ``mean`` (unbiased, unlike
    squaring one noisy mean)."""
    t = np.asarray(tables, dtype=np.float64)
    half = t.shape[0] // 2
    d_a = t[:half].mean(axis=0) - mean
    d_b = t[half : 2 * half].mean(axis=0) - mean
    return float((d_a * d_b * weight).sum())


def batch_sizes(length: int, batch: int) -> list[int]:
    """Sizes of consecutive batches of ``batch`` over ``length`` keys (the last one partial)."""
    sizes = [batch] * (length // batch)
    if length % batch:
        sizes.append(length % batch)
    return sizes


def expected_distinct_labels(class_counts: np.ndarray, sizes: list[int] | int) -> float:
    """Mean number of distinct labels per batch under a uniform shuffle (docs/design.md §15), for
    ``class_counts`` and ``sizes`` the batch sizes as emitted (the result is their mean) or one int."""
    counts = np.asarray(class_counts, dtype=np.float64)
    counts = counts[counts > 0]
    n = float(counts.sum())
    per = [int(sizes)] if isinstance(sizes, (int, np.integer)) else [int(b) for b in sizes]
    total = 0.0
    for b, times in zip(*np.unique(per, return_counts=True)):
        b = int(b)
        if not 0 < b <= n:
            raise ValueError(f"batch size {b} must be in 1..{int(n)}")
        if counts.size * b <= 10_000_000:
            j = np.arange(b, dtype=np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.log1p(-counts[:, None] / (n - j[None, :])).sum(axis=1)
        else:
            logs = (_special.gammaln(n - counts + 1) - _special.gammaln(np.maximum(n - counts - b, 0) + 1)
                    - _special.gammaln(n + 1) + _special.gammaln(n - b + 1))
        miss = np.where(counts + b > n, 0.0, np.exp(logs))
        total += float(times) * float((1.0 - miss).sum())
    return total / len(per)


def distinct_per_batch(codes: np.ndarray, batch: int | Sequence[int]) -> np.ndarray:
    """Mean number of distinct labels per batch of each row of ``codes`` (``[rows, k]`` integers);
    ``batch`` is one size (the last batch partial) or the sizes as emitted, adding up to k."""
    c = np.asarray(codes, dtype=np.int64)
    if c.ndim == 1:
        c = c[None, :]
    rows, k = c.shape
    if not isinstance(batch, (int, np.integer)):
        sizes = [int(b) for b in batch]
        if sum(sizes) != k or min(sizes, default=1) < 1:
            raise ValueError(f"batch sizes add up to {sum(sizes)}, expected {k} keys per row")
        edges = np.cumsum([0, *sizes])
        total = np.zeros(rows)
        for a, b in itertools.pairwise(edges):
            part = np.sort(c[:, a:b], axis=1)
            total += 1 + (np.diff(part, axis=1) != 0).sum(axis=1)
        out: np.ndarray = total / len(sizes)
        return out
    full = k // batch
    total = np.zeros(rows)
    if full:
        blocks = np.sort(c[:, : full * batch].reshape(rows, full, batch), axis=2)
        total += (1 + (np.diff(blocks, axis=2) != 0).sum(axis=2)).sum(axis=1)
    if k % batch:
        tail = np.sort(c[:, full * batch :], axis=1)
        total += 1 + (np.diff(tail, axis=1) != 0).sum(axis=1)
    out = total / (full + (1 if k % batch else 0))
    return out


def row_spearman(rows: np.ndarray) -> np.ndarray:
    """Spearman's rho between each row's values (ties averaged) and their positions ``0..k-1``; NaN for
    a row of equal values. Under an exchangeable order: mean 0, variance ``1 / (k - 1)``."""
    r = np.asarray(_stats.rankdata(np.asarray(rows), axis=1), dtype=np.float64)
    k = r.shape[1]
    pos = np.arange(k, dtype=np.float64) - (k - 1) / 2
    rc = r - r.mean(axis=1, keepdims=True)
    denom = np.sqrt((rc**2).sum(axis=1) * float((pos**2).sum()))
    with np.errstate(invalid="ignore", divide="ignore"):
        out: np.ndarray = (rc * pos[None, :]).sum(axis=1) / denom
    return out
