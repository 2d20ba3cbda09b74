"""Array helpers on record keys shared by the readers, the orders and the tiers (below them all)."""

from __future__ import annotations

import numpy as np

__all__ = ["distinct_sorted"]


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` as int64 by a sort and a comparison: numpy 2's ``unique`` of integers
    goes through a hash table, many times slower on the half million keys of a block, and its first
    call imports ``numpy.ma``, a fifth of a second in a fresh process."""
    out = np.sort(np.asarray(values, dtype=np.int64).reshape(-1))
    if out.size < 2:
        return out
    keep = np.empty(out.size, dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out if keep.all() else out[keep]
