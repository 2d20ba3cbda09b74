"""Randomness metrics for the order in which a loader emits records, as ``benchmarks/compare.py`` reports
them: a thin layer over :mod:`shardkit.ordertest` (the statistics live there, with their proofs and
tests; ``shardkit order-test`` runs the whole battery on any loader's keys).

Every loader in ``benchmarks/compare.py`` is scored on the keys it emits (a key is the record's
storage position, 0..N-1). Four questions, each with its value under an exactly uniform shuffle:

* **Is every item equally likely at every position?** :func:`uniformity_chi2`: the item x position
  table over many epochs, Pearson's statistic scaled by (N-1)/N (a sum of permutation matrices has a
  larger variance than the textbook contingency table), chi-square with (R-1)(C-1) dof.
* **Do storage neighbours stay neighbours?** :func:`adjacent_pairs_test`: consecutive emitted pairs
  from the same storage block, against their exact mean and variance under a uniform shuffle (block
  and shard shuffles pass the chi-square, which sees each item alone, and fail this).
* **Do batches mix the classes?** :func:`distinct_labels_per_batch` against
  :func:`expected_distinct_labels` (exact, hypergeometric).
* **Does the emitted order follow storage order?** :func:`storage_spearman`: Spearman's rho between
  storage and emitted position; its standard deviation under a uniform shuffle is ``1 / sqrt(N - 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _stats

from shardkit.ordertest import Settings
from shardkit.ordertest import stats as _st

__all__ = [
    "ALPHA",
    "ChiSquare",
    "PairTest",
    "adjacent_pairs_test",
    "position_table",
    "uniformity_chi2",
    "distinct_labels_per_batch",
    "expected_distinct_labels",
    "storage_spearman",
    "spearman_null_sd",
    "default_batch_sizes",
]

#: Significance level of the verdicts: the order-test battery's default (``shardkit order-test``).
ALPHA = Settings().alpha


class _Verdict:
    """A test result that passes when uniformity is *not* rejected at level ``alpha``."""

    pvalue: float

    def passes(self, alpha: float = ALPHA) -> bool:
        """True when uniformity is *not* rejected at level ``alpha``."""
        return self.pvalue >= alpha


@dataclass(frozen=True)
class ChiSquare(_Verdict):
    """Result of :func:`uniformity_chi2`: the scaled statistic ``X2 (N-1)/N``, its dof, p-value, epochs."""

    statistic: float
    dof: int
    pvalue: float
    epochs: int


def _as_orders(orders: Sequence[np.ndarray] | np.ndarray, n: int) -> np.ndarray:
    arr = np.asarray(orders, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != n:
        raise ValueError(f"orders: expected an [epochs, {n}] array of keys, found shape {arr.shape}")
    bad = np.flatnonzero(~(np.sort(arr, axis=1) == np.arange(n)).all(axis=1))
    if bad.size:
        raise ValueError(f"orders: epoch {int(bad[0])} is not a permutation of 0..{n - 1}")
    return arr


def _bins(value: int | None, n: int, what: str) -> int:
    b = n if value is None else int(value)
    if not 1 < b <= n:
        raise ValueError(f"{what} must be in 2..{n}, found {b}")
    return b


def position_table(
    orders: Sequence[np.ndarray] | np.ndarray, n: int, *, item_bins: int | None = None, pos_bins: int | None = None
) -> np.ndarray:
    """Counts ``[item_bin, position_bin]`` of where each item was emitted, summed over epochs.

    ``item_bins`` / ``pos_bins``: contiguous near-equal bins (``None``: one per item / position).
    """
    arr = _as_orders(orders, n)
    return _st.position_table(arr, n, _bins(item_bins, n, "item_bins"), _bins(pos_bins, n, "pos_bins"))


def uniformity_chi2(
    orders: Sequence[np.ndarray] | np.ndarray, n: int, *, item_bins: int | None = None, pos_bins: int | None = None
) -> ChiSquare:
    """Chi-square test that every item is equally likely at every position (see
    :func:`shardkit.ordertest.stats.item_position_statistic` for why the statistic is scaled)."""
    arr = _as_orders(orders, n)
    r, c = _bins(item_bins, n, "item_bins"), _bins(pos_bins, n, "pos_bins")
    stat, _ = _st.item_position_statistic(_st.position_table(arr, n, r, c), n, n, arr.shape[0])
    dof = (r - 1) * (c - 1)
    return ChiSquare(statistic=stat, dof=dof, pvalue=float(_stats.chi2.sf(stat, dof)), epochs=int(arr.shape[0]))


@dataclass(frozen=True)
class PairTest(_Verdict):
    """Result of :func:`adjacent_pairs_test`.

    Attributes
    ----------
    mean
        Mean number per epoch of consecutive emitted pairs whose keys share a storage block.
    expected
        Its exact value under a uniform shuffle.
    statistic
        z of the mean against ``expected``, with the exact per-epoch variance.
    pvalue
        Two-sided p-value.
    epochs
        Number of epochs.
    """

    mean: float
    expected: float
    statistic: float
    pvalue: float
    epochs: int


def adjacent_pairs_test(orders: Sequence[np.ndarray] | np.ndarray, n: int, block: int) -> PairTest:
    """Do records stored close together come out next to each other more often than chance?

    Counts, per epoch, the consecutive emitted pairs whose keys fall in the same storage block of
    ``block`` keys; under a uniform permutation its mean is ``sum_b s_b (s_b - 1) / N`` and its
    variance is exact (:func:`shardkit.ordertest.stats.same_bin_pair_moments`), so the mean over
    independent epochs is a z-test (no t approximation, valid from one epoch on).
    """
    arr = _as_orders(orders, n)
    if not 1 < block <= n:
        raise ValueError(f"block must be in 2..{n}, found {block}")
    b = arr // block
    counts = (b[:, 1:] == b[:, :-1]).sum(axis=1).astype(np.float64)
    expected, var = _st.same_bin_pair_moments(np.bincount(np.arange(n) // block).astype(np.float64), n)
    e = counts.shape[0]
    mean = float(counts.mean())
    if var <= 0:
        z = 0.0 if mean == expected else math.inf
    else:
        z = (mean - expected) / math.sqrt(var / e)
    return PairTest(mean=mean, expected=expected, statistic=z, pvalue=float(2 * _stats.norm.sf(abs(z))), epochs=e)


def distinct_labels_per_batch(labels: np.ndarray, batch_sizes: Sequence[int]) -> float:
    """Mean number of distinct labels in consecutive batches of ``labels`` (emitted order).

    ``batch_sizes`` are the sizes of the batches as the loader emitted them (they must add up to
    ``len(labels)``): DataLoader workers may emit several partial batches.
    """
    codes = np.unique(np.asarray(labels).reshape(-1), return_inverse=True)[1].reshape(-1)
    return float(_st.distinct_per_batch(codes, [int(b) for b in batch_sizes])[0])


def expected_distinct_labels(class_counts: Sequence[int], batch_sizes: Sequence[int] | int) -> float:
    """Mean number of distinct labels per batch under a uniform shuffle (hypergeometric; see
    :func:`shardkit.ordertest.stats.expected_distinct_labels`)."""
    sizes = int(batch_sizes) if isinstance(batch_sizes, (int, np.integer)) else [int(b) for b in batch_sizes]
    return _st.expected_distinct_labels(np.asarray(class_counts), sizes)


def storage_spearman(keys: np.ndarray) -> float:
    """Spearman correlation between storage position (the key) and emitted position in one epoch.

    ~0 (sd ``1/sqrt(N-1)``) for a uniform shuffle; near 1 for buffer shuffles over sequential reads.
    """
    keys = np.asarray(keys).reshape(-1)
    if keys.size < 3:
        raise ValueError(f"need at least 3 keys, found {keys.size}")
    return float(_st.row_spearman(keys[None, :])[0])


def spearman_null_sd(n: int) -> float:
    """Standard deviation of Spearman's rho between two independent uniform orders of n items."""
    return 1.0 / math.sqrt(n - 1)


def default_batch_sizes(n: int, batch_size: int) -> list[int]:
    """Batch sizes of one epoch of ``n`` records in batches of ``batch_size`` (last one partial)."""
    return _st.batch_sizes(n, batch_size)
