"""The static cache tier: a uniformly random subset of records pinned in RAM for the whole run.

This is CoorDL's MinIO policy. A page cache (LRU) thrashes under a fresh random order every epoch
and, with sequential shard reads, evicts exactly what the next epoch needs; a cache that never
evicts instead hits exactly its own size every epoch. With ``M`` of ``N`` records pinned, every
epoch after the first reads ``N - M`` records from disk, and pinned records are never read again.

Design choices (documented for users in :class:`~shardkit.readers.TieredSampler`):

* **The pinned set P** is a uniform ``M``-subset of all ``N`` keys drawn once per run from
  ``seeds.rng(Domain.STATIC_CACHE, seed)``, a stream no epoch order or replacement reservoir can
  share for any seeds. P decides *where* records come from, never *which order* they are emitted
  in: the order is the sampler's ``pi`` with or without the cache, so it stays exactly uniform.
* **A separate budget**: the static cache is RAM on top of ``ram_size`` (the double-buffered RAM
  blocks are sized exactly as without it), so turning it on never shrinks the blocks and never
  changes ``K``.
* **Ranks**: every consumer pins the same P (it depends on the seed only) — a subset of the whole
  dataset, not of its own keys, because a consumer's keys change every epoch. Each consumer serves
  from P those of its own keys that are pinned; its disk bytes per epoch are the bytes of its
  unpinned keys (expected fraction ``1 - M/N`` of its share).
* **Loading**: in the first epoch of the run, before the first block, P is read once with
  ascending offsets (one :meth:`~shardkit.formats.PayloadArray.read` pass) into one numpy array. It
  stays loaded across iterations and epochs until :meth:`TieredSampler.close`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from shardkit.errors import SamplerError
from shardkit.formats import PayloadArray, ReadStats
from shardkit.readers.seeds import Domain, rng

__all__ = ["StaticCache", "pinned_keys"]


def pinned_keys(seed: int, num_records: int, count: int) -> np.ndarray:
    """The pinned set P: a uniform ``count``-subset of ``range(num_records)``, ascending."""
    keys = rng(Domain.STATIC_CACHE, seed).choice(int(num_records), size=int(count), replace=False)
    return np.sort(keys).astype(np.int64, copy=False)


class StaticCache:
    """Pinned records of one sampler: their keys (ascending) and, once loaded, their payload.

    Thread-safe loading: the first creator thread that needs the cache loads it; later runs of the
    same sampler reuse it.
    """

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = np.asarray(keys, dtype=np.int64)
        self.data: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return int(self.keys.size)

    def ensure_loaded(self, payload: PayloadArray, stop: threading.Event | None = None) -> bool:
        """Read P from ``payload`` (ascending offsets, one pass) unless already loaded; True if read now.

        ``stop`` is for caches that may wait for another process (the node cache); this one does not.
        """
        with self._lock:
            if self.data is not None:
                return False
            data = payload.empty(self.count)
            payload.read(self.keys, out=data)
            self.data = data
            return True

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(hit, row)``: which of ``keys`` are pinned, and each one's row in :attr:`data`."""
        if self.count == 0:
            return np.zeros(keys.shape, dtype=bool), np.zeros(keys.shape, dtype=np.int64)
        row = np.searchsorted(self.keys, keys)
        row = np.minimum(row, self.count - 1)
        return self.keys[row] == keys, row

    def release(self) -> None:
        """Free the payload (it is read again if the sampler is iterated again)."""
        with self._lock:
            self.data = None

    def fill(
        self,
        keys: np.ndarray,
        out: np.ndarray,
        read: Callable[[np.ndarray, np.ndarray], None],
        stats: ReadStats | None = None,
    ) -> np.ndarray:
        """Fill ``out`` with records ``keys``: unpinned ones through ``read(keys, out)``, pinned ones
        copied from the cache. Returns ``rows`` such that ``out[rows[j]]`` is record ``keys[j]``.

        Unpinned records land in ``out[:u]`` straight from storage (no extra copy), pinned ones in
        ``out[u:]``; the batch creator gathers through ``rows``.
        """
        if self.data is None:
            raise SamplerError("static cache: used before it was loaded (internal error)")
        hit, crow = self.lookup(keys)
        miss_idx = np.flatnonzero(~hit)
        hit_idx = np.flatnonzero(hit)
        u = int(miss_idx.size)
        if u:
            read(keys[miss_idx], out)
        if hit_idx.size:
            out[u : u + hit_idx.size] = self.data[crow[hit_idx]]
            if stats is not None:
                stats.add("static-cache", 0, int(hit_idx.size) * int(self.data[0].nbytes))
                stats.add_records(int(hit_idx.size))
        rows = np.empty(keys.size, dtype=np.int64)
        rows[miss_idx] = np.arange(u, dtype=np.int64)
        rows[hit_idx] = u + np.arange(hit_idx.size, dtype=np.int64)
        return rows
