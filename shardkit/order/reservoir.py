"""Streaming reservoir sampling: Vitter's Algorithm R and Li's Algorithm L, each a uniform random
``k``-subset of a stream of unknown length, whose slot order is *not* uniform (docs/design.md §4, modes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shardkit.errors import ConfigError

__all__ = ["algorithm_r", "algorithm_l", "sample_of_sample", "reservoir_keys"]


def _check_k(k: int) -> int:
    k = int(k)
    if k < 0:
        raise ConfigError(f"reservoir size must be >= 0, found {k}")
    return k


def _as_array(items: list[Any]) -> np.ndarray:
    return np.asarray(items) if items else np.empty(0, dtype=np.int64)


def algorithm_r(items: Iterable[Any], k: int, rng: np.random.Generator) -> np.ndarray:
    """Vitter's Algorithm R: a uniform ``k``-subset of ``items`` (all of them if fewer than ``k``):
    item ``i`` past the first ``k`` replaces a uniform slot with probability ``k / (i + 1)``."""
    k = _check_k(k)
    reservoir: list[Any] = []
    if k == 0:
        return _as_array(reservoir)
    for i, item in enumerate(items):
        if i < k:
            reservoir.append(item)
            continue
        j = int(rng.integers(0, i + 1))
        if j < k:
            reservoir[j] = item
    return _as_array(reservoir)


def _log_u(rng: np.random.Generator) -> float:
    # 1 - U is in (0, 1], so the logarithm is finite.
    return math.log(1.0 - float(rng.random()))


def algorithm_l(items: Iterable[Any], k: int, rng: np.random.Generator) -> np.ndarray:
    """Li's Algorithm L: the same distribution as R with geometric skips (``floor(log U / log(1 - w))``,
    ``w`` the running threshold); on a sequence the skips are index arithmetic."""
    k = _check_k(k)
    if k == 0:
        return _as_array([])
    if isinstance(items, (Sequence, np.ndarray)):
        n = len(items)
        if n <= k:
            return _as_array(list(items))
        reservoir = list(items[:k])
        i = k - 1
        w = math.exp(_log_u(rng) / k)
        while True:
            if w >= 1.0:  # underflow guard: p(accept) ~ 0, nothing more will be accepted
                break
            i += int(math.floor(_log_u(rng) / math.log1p(-w))) + 1
            if i >= n:
                break
            reservoir[int(rng.integers(0, k))] = items[i]
            w *= math.exp(_log_u(rng) / k)
        return _as_array(reservoir)
    it = iter(items)
    reservoir = list(itertools.islice(it, k))
    if len(reservoir) < k:
        return _as_array(reservoir)
    w = math.exp(_log_u(rng) / k)
    while w < 1.0:
        skip = int(math.floor(_log_u(rng) / math.log1p(-w)))
        nxt = next(itertools.islice(it, skip, None), _SENTINEL)
        if nxt is _SENTINEL:
            break
        reservoir[int(rng.integers(0, k))] = nxt
        w *= math.exp(_log_u(rng) / k)
    return _as_array(reservoir)


_SENTINEL = object()


def sample_of_sample(reservoir: Iterable[Any], m: int, rng: np.random.Generator) -> np.ndarray:
    """A uniform ``m``-subset of a reservoir (Theorem 3: still a uniform ``m``-subset of the source).

    This is how a faster tier samples from a slower one in replacement mode.
    """
    return algorithm_l(reservoir, m, rng)


def reservoir_keys(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """One replacement-mode reservoir: a uniform ``min(k, n)``-subset of ``range(n)`` in uniformly
    random order (int64)."""
    sample = algorithm_l(range(int(n)), min(int(k), int(n)), rng).astype(np.int64, copy=False)
    return rng.permutation(sample)
