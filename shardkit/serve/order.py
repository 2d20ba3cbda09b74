"""The order of a shared tier stack: the server's partition into reservoirs and each job's permutations.

Separate random domains (``SERVER_PARTITION``, ``JOB_PERMUTATION``) keep the two independent, which
makes each job's order exactly uniform (docs/design.md §8).
"""

from __future__ import annotations

import numpy as np

from shardkit.order.seeds import Domain, rng

__all__ = ["blocks", "partition", "job_permutation", "job_order"]


def blocks(n: int, k: int, k1: int | None = None) -> list[tuple[int, int]]:
    """Positions ``[a, b)`` of the published blocks of an epoch of ``n`` keys: ``k`` consecutive ones,
    inside each SSD reservoir of ``k1`` when there is one (sizes never depend on the draw)."""
    outer = [(a, min(a + k1, n)) for a in range(0, n, k1)] if k1 is not None else [(0, n)]
    return [(b, min(b + k, hi)) for lo, hi in outer for b in range(lo, hi, k)]


def partition(seed: int, epoch: int, n: int) -> np.ndarray:
    """``pi_e``: the server's uniform permutation of ``range(n)`` for ``(seed, epoch)``."""
    return rng(Domain.SERVER_PARTITION, seed, epoch).permutation(int(n)).astype(np.int64, copy=False)


def job_permutation(job_seed: int, epoch: int, reservoir: int, n: int) -> np.ndarray:
    """A job's permutation of a reservoir's ``n`` stored (ascending) keys."""
    return rng(Domain.JOB_PERMUTATION, job_seed, epoch, reservoir).permutation(int(n))


def job_order(seed: int, job_seed: int, epoch: int, n: int, k: int, k1: int | None = None) -> np.ndarray:
    """The whole epoch order job ``job_seed`` sees from a server ``seed`` with blocks of ``k`` (and ``k1``),
    recomputed without a server: to audit or reproduce a run."""
    pi = partition(seed, epoch, n)
    parts = []
    for r, (a, b) in enumerate(blocks(n, k, k1)):
        stored = np.sort(pi[a:b])
        parts.append(stored[job_permutation(job_seed, epoch, r, stored.size)])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
