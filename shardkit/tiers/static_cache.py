"""The static cache tier: a uniformly random subset of records pinned in RAM for the whole run
(CoorDL's policy), filled by the epoch's own reads and shared per node (docs/design.md §4, *Static cache*).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from shardkit.errors import SamplerError
from shardkit.formats.mapping import populate, reserve_ranges
from shardkit.formats.reader import aligned_empty
from shardkit.order.bijection import ROUNDS, FeistelPermutation
from shardkit.order.locality import node_partition
from shardkit.order.seeds import Domain, rng
from shardkit.tiers import shm as node
from shardkit.tiers.mapped import MappedShards

__all__ = [
    "StaticCache",
    "cache_variant",
    "region_allocated_first",
    "Ahead",
    "pinned_keys",
    "PinnedSet",
    "SortedKeys",
    "AllKeys",
    "BijectionKeys",
]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
#: Bytes of the cache's rows allocated per call by the background thread (a stop request is seen
#: between two).
PREFAULT_CHUNK_BYTES = 8 << 20
#: Page ranges of an announced block allocated per call (by the allocation thread or the reader,
#: whichever claims them first).
AHEAD_RANGES = 64
#: Keys compared per step in :meth:`SortedKeys.lookup` (bounded temporaries).
_LOOKUP_PIECE = 1 << 16


def pinned_keys(seed: int, num_records: int, count: int) -> np.ndarray:
    """The pinned set P: a uniform ``count``-subset of ``range(num_records)``, ascending."""
    keys = rng(Domain.STATIC_CACHE, seed).choice(int(num_records), size=int(count), replace=False)
    return np.sort(keys).astype(np.int64, copy=False)


class PinnedSet(Protocol):
    """Which keys are pinned, and the cache row of each."""

    @property
    def count(self) -> int:
        """``M``."""
        ...

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(hit, row)``: which of ``keys`` are pinned, and each one's row (meaningful where hit)."""
        ...

    def keys(self) -> np.ndarray:
        """Every pinned key, ascending."""
        ...


class SortedKeys:
    """P as its sorted keys (row = rank in P); the keys may live in node-shared memory."""

    def __init__(self, keys: np.ndarray) -> None:
        self._keys = keys

    @property
    def count(self) -> int:
        return int(self._keys.shape[0])

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.count == 0:
            return np.zeros(keys.shape, dtype=bool), np.zeros(keys.shape, dtype=np.int64)
        # A block's keys at a time: the row array is the only block-sized int64 (in place, the
        # comparison in pieces), since a block of small records holds millions of keys.
        row = np.searchsorted(self._keys, keys).astype(np.int64, copy=False)
        np.minimum(row, self.count - 1, out=row)
        hit = np.empty(keys.shape, dtype=bool)
        for a in range(0, row.size, _LOOKUP_PIECE):
            np.equal(self._keys[row[a : a + _LOOKUP_PIECE]], keys[a : a + _LOOKUP_PIECE], out=hit[a : a + _LOOKUP_PIECE])
        return hit, row

    def keys(self) -> np.ndarray:
        return np.array(self._keys, dtype=np.int64)


class AllKeys:
    """P = every key (the whole dataset is cached): row = key."""

    def __init__(self, n: int) -> None:
        self.n = int(n)

    @property
    def count(self) -> int:
        return self.n

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(keys.shape, dtype=bool), np.asarray(keys, dtype=np.int64)

    def keys(self) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64)


class BijectionKeys:
    """P = ``{k : sigma(k) < M}`` for a keyed bijection ``sigma`` of ``range(N)``: row = ``sigma(k)``;
    a (statistically) uniform ``M``-subset with no memory per key, for datasets too large for
    :func:`pinned_keys`."""

    def __init__(self, seed: int, n: int, m: int) -> None:
        keys = rng(Domain.STATIC_CACHE_BIJECTION, seed).integers(0, 2**64, size=ROUNDS, dtype=np.uint64)
        self.sigma = FeistelPermutation(max(1, int(n)), keys)
        self.n, self.m = int(n), int(m)

    @property
    def count(self) -> int:
        return self.m

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row = self.sigma(keys)
        return row < self.m, row

    def keys(self) -> np.ndarray:
        out = [a + np.flatnonzero(self.sigma(np.arange(a, min(a + (1 << 20), self.n))) < self.m)
               for a in range(0, self.n, 1 << 20)]  # fmt: skip
        return np.concatenate(out).astype(np.int64) if out else np.empty(0, np.int64)


def cache_variant(count: int, num_records: int, *, bijection: bool = False, part: bool = False) -> str:
    """How a cache of ``count`` of ``num_records`` records holds its set P: ``all``, ``node`` (a node's
    part), ``bijection`` (drawn from the order's permutation) or ``sorted`` (its sorted keys)."""
    return "all" if count >= num_records else "node" if part else ("bijection" if bijection else "sorted")


def region_allocated_first(count: int, num_records: int, *, shared: bool, bijection: bool = False) -> bool:
    """Whether a cache's whole region is allocated before its first batch (:meth:`StaticCache.attach`):
    a node-shared cache held as its sorted keys writes them after its rows, so it reserves the rows
    with them, where other caches leave their rows to the reads and the allocation thread."""
    return shared and count > 0 and cache_variant(count, num_records, bijection=bijection) in ("sorted", "node")


def _private_rows(m: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, mmap.mmap | None]:
    """Rows of a cache private to this process: an anonymous private mapping (page aligned, and its
    pages can be allocated ahead of the writes), or ``aligned_empty`` where there is none."""
    nbytes = int(m) * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return aligned_empty(m, shape, dtype), None
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return np.frombuffer(mapping, dtype=dtype).reshape((int(m), *shape)), mapping


def _populate(mapping: mmap.mmap, offset: int, length: int) -> bool:
    """Allocate bytes ``[offset, offset + length)`` of a private mapping without writing them
    (``MADV_POPULATE_WRITE``); False where the kernel cannot (nothing else may touch rows a reader
    is filling)."""
    try:
        populate(mapping, offset, length)
    except (OSError, ValueError):
        return False
    return True


class Ahead:
    """Page ranges ``[starts, ends)`` of a block's cache rows to allocate before the reader writes
    them (:meth:`StaticCache.expect`): the allocation thread and the reader claim them
    ``AHEAD_RANGES`` at a time from the front, so the two share the work and nothing is allocated
    twice; ``ok`` says which ranges found memory."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        self.starts, self.ends = starts, ends
        self.ok = np.zeros(starts.size, dtype=bool)
        self._next = 0
        self._running = 0
        self._cond = threading.Condition()

    def claim(self) -> tuple[int, int] | None:
        """The next ranges ``[i, j)`` to allocate, or None when every range is claimed."""
        with self._cond:
            if self._next >= self.starts.size:
                return None
            i = self._next
            self._next = j = min(self.starts.size, i + AHEAD_RANGES)
            self._running += 1
            return i, j

    def finish(self, i: int, j: int, ok: list[bool]) -> None:
        """Ranges ``[i, j)`` are allocated (``ok``: which of them found memory)."""
        with self._cond:
            self.ok[i:j] = ok
            self._running -= 1
            self._cond.notify_all()

    def run(self, allocate: Callable[[list[tuple[int, int]]], list[bool]], stop: threading.Event | None = None) -> None:
        """Allocate claimed ranges until none is left (or ``stop`` is set)."""
        while (stop is None or not stop.is_set()) and (span := self.claim()) is not None:
            i, j = span
            try:
                ok = allocate(list(zip(self.starts[i:j].tolist(), (self.ends[i:j] - self.starts[i:j]).tolist())))
            except BaseException:
                self.finish(i, j, [False] * (j - i))
                raise
            self.finish(i, j, ok)

    def wait(self) -> None:
        """Until every claimed range is allocated (call after :meth:`run` found none left)."""
        with self._cond:
            while self._running:
                self._cond.wait()

    def covers(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Which ranges ``[starts, ends)`` lie inside one range of this block that found memory."""
        at = np.searchsorted(self.starts, starts, side="right") - 1
        inside = at >= 0
        at = np.maximum(at, 0)
        if self.starts.size == 0:
            return np.zeros(starts.shape, dtype=bool)
        good: np.ndarray = inside & (ends <= self.ends[at]) & self.ok[at]
        return good


class StaticCache:
    """Pinned records of one sampler: P (``count`` keys drawn from ``seed``), the rows that hold them
    (records of ``record_shape`` and ``dtype``), and which rows are filled. P is drawn with a
    bijection (:class:`BijectionKeys`) when ``bijection``; with ``part = (nodes, node)`` it is node
    ``node``'s part of the node partition. ``share_key`` names the dataset for node sharing
    (``None``: private to this process). ``files``: when it holds every record, the cache may be
    the dataset's own shard files, mapped by the pipeline (:class:`~shardkit.tiers.mapped.MappedShards`):
    :meth:`attach` then maps no rows, only the flags of the records made resident, node-shared like
    rows would be (the pipeline calls :meth:`keep_rows` if the files cannot be mapped)."""

    def __init__(
        self,
        seed: int,
        num_records: int,
        count: int,
        record_shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        bijection: bool = False,
        part: tuple[int, int] | None = None,
        share_key: str | None = None,
        files: bool = False,
    ) -> None:
        self.seed, self.n, self.m = int(seed), int(num_records), int(count)
        self.record_shape, self.dtype = tuple(record_shape), np.dtype(dtype)
        self.part = None if part is None else (int(part[0]), int(part[1]))
        self.variant = cache_variant(self.m, self.n, bijection=bijection, part=part is not None)
        self.share_key = share_key
        self.files = files and self.variant == "all"
        #: The mapped shard files when ``files`` (set by the first pipeline that maps them).
        self.mapped: MappedShards | None = None
        self.rows: np.ndarray | None = None
        self.flags: np.ndarray | None = None
        self.pinned: PinnedSet | None = None
        self.shared = False
        self._region: node.SharedRegion | None = None
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._prefault: threading.Thread | None = None
        self._prefault_stop = threading.Event()
        #: The first this many bytes of the rows are allocated (by the prefault thread).
        self._allocated = 0
        #: Blocks announced by :meth:`expect`, oldest first, that the thread allocates before
        #: going on front to back; ``_wake`` tells it one arrived.
        self._ahead: list[Ahead] = []
        self._wake = threading.Event()
        #: Set when the front-to-back pass is over (every row allocated, or an allocation failed).
        self._swept = threading.Event()
        #: The reader announces its blocks: the front-to-back pass stops (it would populate again,
        #: for a page walk each, the pages the announced blocks allocated).
        self._announcing = False

    @property
    def count(self) -> int:
        return self.m

    @property
    def record_nbytes(self) -> int:
        return int(np.prod(self.record_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def _keyed(self) -> bool:
        """P is held as its sorted keys (:class:`SortedKeys`)."""
        return self.variant in ("sorted", "node")

    def _layout(self) -> tuple[int, int, int]:
        """Byte offsets of the rows and the sorted keys, and the total size of the region."""
        rows_at = -(-self.m // _PAGE) * _PAGE  # flags first, one byte a row, page aligned
        keys_at = rows_at + -(-self.m * self.record_nbytes // _PAGE) * _PAGE
        total = keys_at + (8 * self.m if self._keyed else 0)
        return rows_at, keys_at, total

    def attach(self) -> None:
        """Map the cache: the node's shared region for it when sharing is on, else private memory."""
        with self._lock:
            if self.files:
                self._attach_files()
                return
            if self.rows is not None:
                return
            rows_at, keys_at, total = self._layout()
            region = None
            if self.share_key is not None:
                name = node.region_name("cache", self.share_key, self.variant, self.seed, self.n, self.m,
                                        self.record_shape, self.dtype.str, self.part)  # fmt: skip

                def init(m: mmap.mmap) -> None:
                    if self._keyed:
                        keys = np.frombuffer(m, dtype=np.int64, count=self.m, offset=keys_at)
                        keys[:] = self._sorted_keys()
                        del keys

                region = node.attach(name, total, init, writable=True, reserve=total if self._keyed else rows_at)
            sorted_keys = None
            private: mmap.mmap | None = None
            if region is not None:
                self._region, self.shared = region, True
                self._fd = region._data_fd
                self.flags = region.array(np.uint8, (self.m,))
                self.rows = region.array(self.dtype, (self.m, *self.record_shape), rows_at)
                sorted_keys = region.array(np.int64, (self.m,), keys_at) if self._keyed else None
            else:
                self.flags = np.zeros(self.m, dtype=np.uint8)
                self.rows, private = _private_rows(self.m, self.record_shape, self.dtype)
            self.pinned = self._pinned_set(sorted_keys)
            nbytes = self.m * self.record_nbytes
            if region is not None:
                shared = region
                self._start_prefault(lambda a, n: shared.reserve([(rows_at + a, n)])[0], nbytes, shared.reserve)
            elif private is not None:
                mapping = private
                self._start_prefault(lambda a, n: _populate(mapping, a, n), nbytes)

    def _attach_files(self) -> None:
        """The cache is the mapped files (:attr:`files`; with the lock held): no rows, only the
        flags, which say which records a process made resident. They live in a node-shared region
        when sharing is on, so the node's other consumers (DataLoader workers of the next pass, other
        ranks, other jobs whatever their seed) neither read those records from storage again nor count
        them as read."""
        if self.pinned is None:
            self.pinned = self._pinned_set()
        if self.flags is not None:
            return
        region = None
        if self.share_key is not None:  # one per dataset, not per seed: residency is the files', whatever the order
            name = node.region_name("cache", self.share_key, "files", self.n, self.record_shape, self.dtype.str)
            region = node.attach(name, self.n, lambda m: None, writable=True)
        if region is not None:
            self._region, self.shared, self._fd = region, True, region._data_fd
            self.flags = region.array(np.uint8, (self.n,))
        else:
            self.flags = np.zeros(self.n, dtype=np.uint8)

    def keep_rows(self) -> None:
        """The files cannot be mapped: hold a copy in rows of its own instead (the files' flags are
        let go; the next :meth:`attach` maps the rows)."""
        with self._lock:
            if not self.files:
                return
            self.files = False
            self.flags = None
            self.pinned = None
            region, self._region, self._fd = self._region, None, None
            self.shared = False
        if region is not None:
            region.release()

    def _start_prefault(self, allocate: Callable[[int, int], bool], nbytes: int,
                        ranges: Callable[[list[tuple[int, int]]], list[bool]] | None = None) -> None:
        """Allocate the rows' memory front to back on a thread of its own, ``allocate(offset,
        length)`` a chunk at a time, until it fails (the node's memory is short: the reader's own
        :meth:`reserve` then decides, row by row) or the cache is released. Blocks the reader
        announced (:meth:`expect`) come first, allocated with ``ranges`` (region offsets).

        Every row is written in the first epoch, and allocating a page (a fault, and zeroing it) cost
        the reader several times what reading its bytes did: 0.8 of the reader's 1.1 CPU seconds per
        753 MB, a first epoch 3-4x slower than with no cache. On this thread it runs beside the reads;
        a page the thread has not reached yet is still allocated by the reader's ``reserve``."""
        self._prefault_stop.clear()
        self._swept.clear()
        self._announcing = False
        self._allocated = 0

        def announced() -> None:
            while ranges is not None and not self._prefault_stop.is_set():
                with self._lock:
                    job = self._ahead[0] if self._ahead else None
                if job is None:
                    return
                job.run(ranges, self._prefault_stop)
                with self._lock:
                    if self._ahead and self._ahead[0] is job:
                        self._ahead.pop(0)

        def run() -> None:
            offset = 0
            while offset < nbytes and not self._announcing:  # a reader that announces its blocks needs no pass
                announced()
                length = min(PREFAULT_CHUNK_BYTES, nbytes - offset)
                if self._prefault_stop.is_set() or not allocate(offset, length):
                    break
                offset += length
                self._allocated = offset  # the reader's reserve skips what lies below
            self._swept.set()
            while ranges is not None and not self._prefault_stop.is_set():  # the rest: announced blocks only
                announced()
                self._wake.wait()  # expect() and release() set it
                self._wake.clear()

        self._prefault = threading.Thread(target=run, name="shardkit-cache-prefault", daemon=True)
        self._prefault.start()

    def _stop_prefault(self) -> None:
        """Stop the allocation thread and wait for it (before the rows are let go)."""
        self._prefault_stop.set()
        self._wake.set()
        thread, self._prefault = self._prefault, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _pinned_set(self, sorted_keys: np.ndarray | None = None) -> PinnedSet:
        """P in the form of the variant (``sorted_keys``: P's keys already at hand, e.g. shared)."""
        if self.variant == "all":
            return AllKeys(self.n)
        if self.variant == "bijection":
            return BijectionKeys(self.seed, self.n, self.m)
        return SortedKeys(self._sorted_keys() if sorted_keys is None else sorted_keys)

    def keys(self) -> np.ndarray:
        """The pinned keys P, ascending (computed without attaching the storage)."""
        return (self.pinned or self._pinned_set()).keys()

    def _sorted_keys(self) -> np.ndarray:
        """P as sorted keys: drawn for the static cache, or this node's part of the node partition."""
        if self.part is None:
            return pinned_keys(self.seed, self.n, self.m)
        nodes, me = self.part
        keys = node_partition(self.seed, self.n, nodes, self.m).pinned_keys(me)
        if keys.size != self.m:
            raise SamplerError(f"static cache: node {me} of {nodes} pins {keys.size} records, expected {self.m} (internal error)")
        return keys

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(hit, row)``: which of ``keys`` are pinned, and each one's cache row."""
        self.attach()
        assert self.pinned is not None
        return self.pinned.lookup(np.asarray(keys, dtype=np.int64))

    def filled(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` hold their record (published by this or any process of the node)."""
        assert self.flags is not None
        with self._publication(fcntl.LOCK_SH):
            have: np.ndarray = self.flags[rows] != 0
        return have

    def expect(self, rows: np.ndarray) -> Ahead | None:
        """Announce ``rows``, which the reader will fill with its next block: the allocation thread
        allocates their pages before it goes on front to back, while the reader reads the block
        before. Pass the result to :meth:`reserve` of those rows. None: nothing to do ahead (rows
        that are private, or all allocated already).

        A block's rows lie all over the cache (row = key when it holds every record), so the
        front-to-back pass rarely reached them before the reader did, and the reader allocated most
        of its rows itself, between its reads (on a cold first epoch that is time the device idles)."""
        if not self.shared or self._region is None or rows.size == 0 or self._prefault is None:
            return None
        rows_at = self._layout()[0]
        starts, ends, _ = reserve_ranges(rows, rows_at, self.record_nbytes)
        keep = ends > rows_at + self._allocated
        if not keep.any():
            return None
        job = Ahead(starts[keep], ends[keep])
        with self._lock:
            self._ahead.append(job)
            self._announcing = True
        self._wake.set()
        return job

    def reserve(self, rows: np.ndarray, ahead: Ahead | None = None) -> np.ndarray:
        """Make sure ``rows`` have memory before the reader writes them (shared rows are allocated as
        they are first filled); False for rows the node has no memory for. ``ahead``: these rows
        were announced (:meth:`expect`); the reader allocates what the thread has not claimed yet
        and waits for what it has."""
        if self.files or not self.shared or self._region is None or rows.size == 0:
            return np.ones(rows.shape, dtype=bool)
        rows_at = self._layout()[0]
        starts, ends, first = reserve_ranges(rows, rows_at, self.record_nbytes)
        if ahead is not None:
            ahead.run(self._region.reserve)
            ahead.wait()
            with self._lock:
                if ahead in self._ahead:
                    self._ahead.remove(ahead)
        ok = ends <= rows_at + self._allocated  # allocated by the prefault thread already
        if ahead is not None:
            ok |= ahead.covers(starts, ends)
        todo = np.flatnonzero(~ok)
        if todo.size:
            ok[todo] = self._region.reserve(list(zip(starts[todo].tolist(), (ends - starts)[todo].tolist())))
        if ok.all():
            return np.ones(rows.shape, dtype=bool)
        order = np.sort(rows)
        good = ok[np.searchsorted(first, order, side="right") - 1]  # each sorted row's range
        logger.warning("static cache: no memory left in %s for %d rows; they are read like uncached records",
                       node.SHM_ROOT, int(np.count_nonzero(~good)))  # fmt: skip
        return ~np.isin(rows, order[~good])

    def publish(self, rows: np.ndarray) -> None:
        """Mark ``rows`` filled: their bytes are in place (call after writing them)."""
        if rows.size == 0:
            return
        assert self.flags is not None
        with self._publication(fcntl.LOCK_EX):
            self.flags[rows] = 1

    @contextlib.contextmanager
    def _publication(self, how: int) -> Iterator[None]:
        """The publication lock: ``flock`` ``how`` on the shared region's file (orders memory across
        processes), or the cache's thread lock when the rows are private."""
        fd = self._fd if self.shared else None
        if fd is None:
            with self._lock:
                yield
            return
        fcntl.flock(fd, how)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def release(self) -> None:
        """Let go of the rows (the node's last user deletes the shared region); attached again on
        the next use."""
        self._stop_prefault()
        self._allocated = 0
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        with self._lock:
            self._ahead = []
            self.rows = self.flags = None
            self.pinned = None
            region, self._region, self._fd = self._region, None, None
            self.shared = False
        if region is not None:
            region.release()
