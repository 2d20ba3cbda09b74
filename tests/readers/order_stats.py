"""Order statistics for the shared-stack tests (see ANCHORS "How to test an order")."""

from __future__ import annotations

import numpy as np
from scipy import stats

#: Significance level of every statistical test.
ALPHA = 1e-3


def item_position_pvalue(orders: np.ndarray) -> float:
    """p-value of the item x position table of ``orders`` (one permutation of ``range(N)`` per row).

    Over ``T`` uniform permutations the plain Pearson statistic has mean ``N(N-1)``, not ``(N-1)^2``:
    every row fills each row *and* column of the table exactly once, so the cells are negatively
    dependent. Scaled by ``(N-1)/N`` it is approximately chi-square with ``(N-1)^2`` degrees of
    freedom; unscaled, the test rejects uniform orders too often (false alarms).
    """
    t, n = orders.shape
    table = np.zeros((n, n))
    for pos in range(n):
        np.add.at(table[:, pos], orders[:, pos], 1)
    expected = t / n
    stat = ((table - expected) ** 2 / expected).sum() * (n - 1) / n
    return float(stats.chi2.sf(stat, (n - 1) ** 2))
