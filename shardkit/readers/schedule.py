"""The sampler's schedule on keys alone: which keys, in which order, for which consumer.

Everything here is pure numpy on record keys (no payload, no I/O), so it can be tested exhaustively
and the tier stack only has to deliver the keys it is given, in that order.

Global-batch semantics
----------------------
An epoch's *global stream* ``pi`` has ``N`` keys:

* ``epoch`` mode: a uniform random permutation of ``range(N)`` from
  ``np.random.default_rng([seed, epoch])`` (PCG64 seeded through SeedSequence);
* ``replacement`` mode: ``ceil(N / K)`` independent reservoirs, each a uniform ``K``-subset of
  ``range(N)`` drawn with Algorithm L and emitted in uniformly random order, truncated to ``N`` keys;
* ``sequential`` mode: ``range(N)``.

Global batch ``g`` is ``pi[p0 + g*B*W : p0 + (g+1)*B*W]`` where ``p0`` is the resume position, ``B``
the per-consumer batch size and ``W`` the number of consumers; consumer ``c`` takes
``pi[p0 + g*B*W + c*B : p0 + g*B*W + (c+1)*B]``. ``pi`` itself does not depend on ``W``, so a run
resumed at position ``p0`` with another world size continues the same order. In a ragged final
global batch the first consumers get records and the last may get fewer or none; ``drop_last``
drops that incomplete global batch so every consumer gets the same number of batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardkit.errors import ConfigError
from shardkit.readers.reservoir import reservoir_keys

__all__ = ["MODES", "epoch_stream", "epoch_permutation", "replacement_stream", "ConsumerPlan", "consumer_plan"]

MODES = ("epoch", "replacement", "sequential")


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch order ``pi``: a uniform random permutation of ``range(n)`` defined by ``(seed, epoch)``."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(n)).astype(np.int64, copy=False)


def replacement_stream(seed: int, epoch: int, n: int, k: int) -> np.ndarray:
    """``ceil(n / k)`` independent uniform ``k``-reservoirs of ``range(n)``, concatenated, first ``n`` keys."""
    n, k = int(n), max(1, min(int(k), int(n)))
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # A third SeedSequence word keeps replacement streams independent of epoch-mode permutations.
    rng = np.random.default_rng([int(seed), int(epoch), 1])
    parts = [reservoir_keys(n, k, rng) for _ in range(math.ceil(n / k))]
    return np.concatenate(parts)[:n]


def epoch_stream(mode: str, seed: int, epoch: int, n: int, reservoir: int = 1) -> np.ndarray:
    """The global stream of one epoch in ``mode`` (see module docstring); ``reservoir`` is ``K``."""
    if mode == "epoch":
        return epoch_permutation(seed, epoch, n)
    if mode == "replacement":
        return replacement_stream(seed, epoch, n, reservoir)
    if mode == "sequential":
        return np.arange(int(n), dtype=np.int64)
    raise ConfigError(f"mode: expected one of {', '.join(MODES)}, found {mode!r}")


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's share of one epoch from a start position.

    Attributes
    ----------
    keys
        The consumer's keys ``sigma_c`` in emission order (its slices of the global batches).
    batch_sizes
        Length of each of its batches (all ``B`` except possibly the last).
    positions
        Global position (records of ``pi`` consumed) after each of its batches.
    """

    keys: np.ndarray
    batch_sizes: np.ndarray
    positions: np.ndarray

    @property
    def num_batches(self) -> int:
        return int(self.batch_sizes.shape[0])


def consumer_plan(
    stream: np.ndarray,
    start: int,
    batch_size: int,
    rank: int,
    world_size: int,
    drop_last: bool = False,
) -> ConsumerPlan:
    """Slice consumer ``rank`` of ``world_size`` out of ``stream[start:]`` (global-batch semantics)."""
    n = int(stream.shape[0])
    b, w, c, start = int(batch_size), int(world_size), int(rank), int(start)
    gb = b * w
    rest = max(0, n - start)
    full = rest // gb
    tail = rest - full * gb
    # Full global batches: consumer c's slice is B records at offset c*B inside each.
    idx = start + (np.arange(full, dtype=np.int64) * gb + c * b)[:, None] + np.arange(b, dtype=np.int64)[None, :]
    keys = [stream[idx.reshape(-1)]]
    sizes = [np.full(full, b, dtype=np.int64)]
    positions = [start + (np.arange(full, dtype=np.int64) + 1) * gb]
    if tail and not drop_last:
        lo = start + full * gb + c * b
        hi = min(lo + b, n)
        if hi > lo:
            keys.append(stream[lo:hi])
            sizes.append(np.array([hi - lo], dtype=np.int64))
            positions.append(np.array([n], dtype=np.int64))
    return ConsumerPlan(
        keys=np.concatenate(keys).astype(np.int64, copy=False),
        batch_sizes=np.concatenate(sizes),
        positions=np.concatenate(positions),
    )
