"""Randomness metrics for the order in which a loader emits records.

Every loader in ``benchmarks/compare.py`` is scored on the keys it emits (a key is the record's
storage position, 0..N-1). Four questions, each with its value under an exactly uniform shuffle:

* **Is every item equally likely at every position?** :func:`uniformity_chi2` builds the item x
  position contingency table over many epochs and returns Pearson's statistic, its degrees of freedom
  and the p-value. The null distribution is stated precisely there (it is *not* the textbook
  contingency-table one: a sum of permutation matrices has a larger variance).
* **Do storage neighbours stay neighbours?** :func:`adjacent_pairs_test`: consecutive emitted pairs
  from the same storage block, against the exact expectation (block and shard shuffles pass the
  chi-square, which sees each item alone, and fail this).
* **Do batches mix the classes?** :func:`distinct_labels_per_batch` against
  :func:`expected_distinct_labels` (exact, hypergeometric). Buffer and block shuffles over storage
  sorted by class give batches with too few classes (the FFCV quasi-random complaint).
* **Does the emitted order follow storage order?** :func:`storage_spearman`: Spearman's rank
  correlation between storage position and emitted position; its standard deviation under a uniform
  shuffle is ``1 / sqrt(N - 1)``.

Only numpy and scipy are used, so the module is importable without any peer loader.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy import stats as _stats

__all__ = [
    "ChiSquare",
    "PairTest",
    "adjacent_pairs_test",
    "position_table",
    "uniformity_chi2",
    "distinct_labels_per_batch",
    "expected_distinct_labels",
    "storage_spearman",
    "spearman_null_sd",
]


@dataclass(frozen=True)
class ChiSquare:
    """Result of :func:`uniformity_chi2`.

    Attributes
    ----------
    statistic
        The calibrated statistic ``X2 * (N - 1) / N`` (see :func:`uniformity_chi2`).
    dof
        Degrees of freedom ``(R - 1) * (C - 1)`` for R item bins and C position bins.
    pvalue
        Upper-tail probability of ``statistic`` under chi-square(dof).
    epochs
        Number of epochs (permutations) in the table.
    """

    statistic: float
    dof: int
    pvalue: float
    epochs: int

    def passes(self, alpha: float = 1e-3) -> bool:
        """True when uniformity is *not* rejected at level ``alpha``."""
        return self.pvalue >= alpha


def _as_orders(orders: Sequence[np.ndarray] | np.ndarray, n: int) -> np.ndarray:
    arr = np.asarray(orders, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != n:
        raise ValueError(f"orders: expected an [epochs, {n}] array of keys, found shape {arr.shape}")
    expected = np.arange(n)
    for e, row in enumerate(arr):
        if not np.array_equal(np.sort(row), expected):
            raise ValueError(f"orders: epoch {e} is not a permutation of 0..{n - 1}")
    return arr


def position_table(
    orders: Sequence[np.ndarray] | np.ndarray, n: int, *, item_bins: int | None = None, pos_bins: int | None = None
) -> np.ndarray:
    """Counts ``[item_bin, position_bin]`` of where each item was emitted, summed over epochs.

    Parameters
    ----------
    orders
        ``[epochs, n]``: row e is epoch e's emitted keys in order (each a permutation of 0..n-1).
    n
        Number of records.
    item_bins, pos_bins
        Number of equal bins for items (by storage position) and positions; ``None`` = ``n`` (no
        binning). Both must divide ``n`` so every cell has the same expected count.
    """
    arr = _as_orders(orders, n)
    r = n if item_bins is None else int(item_bins)
    c = n if pos_bins is None else int(pos_bins)
    if r <= 1 or c <= 1 or n % r or n % c:
        raise ValueError(f"bins must be > 1 and divide n={n}; found item_bins={r}, pos_bins={c}")
    pos = np.broadcast_to(np.arange(n), arr.shape)
    flat = (arr // (n // r)) * c + pos // (n // c)
    return np.bincount(flat.reshape(-1), minlength=r * c).reshape(r, c)


def uniformity_chi2(
    orders: Sequence[np.ndarray] | np.ndarray, n: int, *, item_bins: int | None = None, pos_bins: int | None = None
) -> ChiSquare:
    """Chi-square test that every item is equally likely at every position.

    Notes
    -----
    Let ``O`` be the (binned) item x position table summed over E epochs, each cell expecting
    ``e = E * g * h / N`` (g items and h positions per bin) and Pearson's ``X2 = sum (O - e)^2 / e``.
    One uniform permutation matrix P has ``Cov(P) = Q (x) Q / (N - 1)`` with ``Q = I - J / N``, so by
    the central limit theorem over epochs ``O - e`` is Gaussian with covariance
    ``E g h / (N - 1) * Q_R (x) Q_C`` (binning keeps the Kronecker form), which gives
    ``X2 ~ N / (N - 1) * chi2((R - 1)(C - 1))``. The textbook contingency test would use the
    hypergeometric variance, which is smaller by the factor ``(N - 1) / N`` and makes a perfect
    shuffle fail for large E. We therefore report ``X2 * (N - 1) / N`` against chi2((R-1)(C-1)).
    Keep ``e`` >= 5 (bin positions) for the Gaussian approximation to hold.
    """
    arr = _as_orders(orders, n)
    table = position_table(arr, n, item_bins=item_bins, pos_bins=pos_bins).astype(np.float64)
    r, c = table.shape
    e = arr.shape[0] * (n // r) * (n // c) / n
    x2 = float(((table - e) ** 2).sum() / e) * (n - 1) / n
    dof = (r - 1) * (c - 1)
    return ChiSquare(statistic=x2, dof=dof, pvalue=float(_stats.chi2.sf(x2, dof)), epochs=int(arr.shape[0]))


@dataclass(frozen=True)
class PairTest:
    """Result of :func:`adjacent_pairs_test`.

    Attributes
    ----------
    mean
        Mean number per epoch of consecutive emitted pairs whose keys share a storage block.
    expected
        Its exact value under a uniform shuffle.
    statistic
        Student t of the per-epoch counts against ``expected``.
    pvalue
        Two-sided p-value (t with ``epochs - 1`` degrees of freedom).
    epochs
        Number of epochs.
    """

    mean: float
    expected: float
    statistic: float
    pvalue: float
    epochs: int

    def passes(self, alpha: float = 1e-3) -> bool:
        return self.pvalue >= alpha


def adjacent_pairs_test(orders: Sequence[np.ndarray] | np.ndarray, n: int, block: int) -> PairTest:
    """Do records stored close together come out next to each other more often than chance?

    The item x position chi-square only sees each item's own position. A shuffle that moves whole
    shards or blocks and then shuffles inside them (MosaicML's py1e, shard shuffles) gives every item a
    uniform position and passes it, yet emits storage neighbours together. This test counts, per
    epoch, the consecutive emitted pairs whose keys fall in the same storage block of ``block`` keys.
    Under a uniform permutation each of the N-1 consecutive pairs is a uniform pair of distinct keys,
    so the expected count is exactly ``sum_b s_b (s_b - 1) / N`` (``block - 1`` when it divides N).
    The per-epoch counts are independent across epochs, so a one-sample t-test is exact in the limit.
    """
    arr = _as_orders(orders, n)
    if not 1 < block <= n:
        raise ValueError(f"block must be in 2..{n}, found {block}")
    b = arr // block
    counts = (b[:, 1:] == b[:, :-1]).sum(axis=1).astype(np.float64)
    sizes = np.bincount(np.arange(n) // block).astype(np.float64)
    expected = float((sizes * (sizes - 1)).sum() / n)
    e = counts.shape[0]
    mean = float(counts.mean())
    sd = float(counts.std(ddof=1)) if e > 1 else 0.0
    if sd == 0.0:
        t = 0.0 if mean == expected else math.inf
        p = 1.0 if mean == expected else 0.0
    else:
        t = (mean - expected) / (sd / math.sqrt(e))
        p = float(2 * _stats.t.sf(abs(t), e - 1))
    return PairTest(mean=mean, expected=expected, statistic=t, pvalue=p, epochs=e)


def _batch_sizes(n: int, batch_size: int, drop_last: bool = False) -> list[int]:
    sizes = [batch_size] * (n // batch_size)
    if n % batch_size and not drop_last:
        sizes.append(n % batch_size)
    return sizes


def distinct_labels_per_batch(labels: np.ndarray, batch_sizes: Sequence[int]) -> float:
    """Mean number of distinct labels in consecutive batches of ``labels`` (emitted order).

    ``batch_sizes`` are the sizes of the batches as the loader emitted them (they must add up to
    ``len(labels)``): DataLoader workers may emit several partial batches.
    """
    labels = np.asarray(labels).reshape(-1)
    if sum(batch_sizes) != labels.shape[0]:
        raise ValueError(f"batch sizes add up to {sum(batch_sizes)}, expected {labels.shape[0]} labels")
    counts, start = [], 0
    for b in batch_sizes:
        counts.append(np.unique(labels[start : start + b]).size)
        start += b
    return float(np.mean(counts))


def expected_distinct_labels(class_counts: Sequence[int], batch_sizes: Sequence[int] | int) -> float:
    """Exact mean number of distinct labels per batch when the order is a uniform random permutation.

    A batch of b records of a uniform permutation is a uniform b-subset of the N records, so class c
    (n_c records) is missing from it with probability ``C(N - n_c, b) / C(N, b)`` and the expected
    number of classes present is ``sum_c 1 - C(N - n_c, b) / C(N, b)``. Computed with exact integers.
    ``batch_sizes`` as emitted (mean over batches), or one int for a single batch size.
    """
    counts = [int(x) for x in class_counts]
    total = sum(counts)
    sizes = [int(batch_sizes)] if isinstance(batch_sizes, (int, np.integer)) else [int(b) for b in batch_sizes]
    acc = Fraction(0)
    for b in sizes:
        if not 0 < b <= total:
            raise ValueError(f"batch size {b} must be in 1..{total}")
        denom = math.comb(total, b)
        acc += sum(1 - Fraction(math.comb(total - k, b), denom) for k in counts)
    return float(acc / len(sizes))


def storage_spearman(keys: np.ndarray) -> float:
    """Spearman correlation between storage position (the key) and emitted position in one epoch.

    ~0 (sd ``1/sqrt(N-1)``) for a uniform shuffle; near 1 for buffer shuffles over sequential reads.
    """
    keys = np.asarray(keys).reshape(-1)
    if keys.size < 3:
        raise ValueError(f"need at least 3 keys, found {keys.size}")
    return float(_stats.spearmanr(keys, np.arange(keys.size)).statistic)


def spearman_null_sd(n: int) -> float:
    """Standard deviation of Spearman's rho between two independent uniform orders of n items."""
    return 1.0 / math.sqrt(n - 1)


def default_batch_sizes(n: int, batch_size: int) -> list[int]:
    """Batch sizes of one epoch of ``n`` records in batches of ``batch_size`` (last one partial)."""
    return _batch_sizes(n, batch_size)
