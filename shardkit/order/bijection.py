"""A keyed pseudo-random permutation of ``range(n)`` evaluated on demand from a few 64-bit round keys
(Feistel network, cycle walking; docs/design.md §4, *The schedule*, huge datasets).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardkit.order.seeds import Domain, rng

__all__ = ["FeistelPermutation", "ROUNDS", "MIN_BITS"]

#: Feistel rounds (Patarin: six or more rounds for security close to the domain size).
ROUNDS = 8
#: Smallest domain: halves of at least 4 bits, so tiny ``n`` still gets real round functions.
MIN_BITS = 8
#: Domains of up to ``2**TABLE_BITS`` values are tabulated once (8 MiB), so cycle walking is a
#: lookup; larger ones evaluate the network per step.
TABLE_BITS = 20

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


#: Positions evaluated per numpy pass (keeps the temporaries in the CPU cache: ~3x faster than
#: whole-array passes at 10^7 positions).
_CHUNK = 1 << 16


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64's finaliser of ``x xor key`` (uint64 arithmetic wraps); one fresh array, the
    rest in place."""
    z = x ^ key
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


class FeistelPermutation:
    """``pi``: a keyed bijection of ``range(n)`` (``n >= 1`` records) from :data:`ROUNDS` uint64
    round ``keys`` (docs/design.md §4)."""

    def __init__(self, n: int, keys: np.ndarray) -> None:
        self.n = int(n)
        if self.n < 1:
            raise ValueError(f"a permutation needs n >= 1, found {n}")
        bits = max(MIN_BITS, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self._shift = np.uint64(self.half)
        self._mask = np.uint64((1 << self.half) - 1)
        self.keys = np.asarray(keys, dtype=np.uint64)
        self._table: np.ndarray | None = None
        if self.keys.shape != (ROUNDS,):
            raise ValueError(f"expected {ROUNDS} round keys, found {self.keys.shape}")

    @classmethod
    def for_epoch(cls, seed: int, epoch: int, n: int) -> FeistelPermutation:
        """The epoch order of ``(seed, epoch)`` (round keys from its own random domain)."""
        keys = rng(Domain.EPOCH_BIJECTION, seed, epoch).integers(0, 2**64, size=ROUNDS, dtype=np.uint64)
        return cls(n, keys)

    def _network(self, x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for a in range(0, x.size, _CHUNK):
            left, right = x[a : a + _CHUNK] >> self._shift, x[a : a + _CHUNK] & self._mask
            for key in self.keys:
                f = _mix(right, key)
                f &= self._mask
                f ^= left
                left, right = right, f
            left <<= self._shift
            left |= right
            out[a : a + _CHUNK] = left
        return out

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """``pi[positions]`` as int64 (positions must lie in ``[0, n)``)."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        step = self._step()
        y = step(p.astype(np.uint64))
        walk = np.flatnonzero(y >= np.uint64(self.n))
        while walk.size:  # cycle walking: leave the padding of the domain
            y[walk] = step(y[walk])
            walk = walk[y[walk] >= np.uint64(self.n)]
        return y.astype(np.int64)

    def _step(self) -> Callable[[np.ndarray], np.ndarray]:
        """One application of the network: a table lookup when the domain is small (computed once,
        at most ``2**TABLE_BITS`` entries), the network itself otherwise."""
        if self.half * 2 > TABLE_BITS:
            return self._network
        if self._table is None:
            self._table = self._network(np.arange(1 << (2 * self.half), dtype=np.uint64))
        table = self._table
        return lambda x: table[x]

    def inverse_network(self, y: np.ndarray) -> np.ndarray:
        """The network's inverse on ``range(2**k)`` (for tests: it is a bijection)."""
        left, right = y >> self._shift, y & self._mask
        for key in self.keys[::-1]:
            left, right = right ^ (_mix(left, key) & self._mask), left
        out: np.ndarray = (left << self._shift) | right
        return out
