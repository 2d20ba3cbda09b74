"""The static cache of a dataset it holds whole, as the shard files' own pages: a local dataset of
fixed-size records is mapped, and the page cache is the cache (docs/design.md §4, *Static cache*).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardkit.formats import PayloadArray
from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.mapping import MappedFile, reserve_ranges
from shardkit.formats.reader import ReadStats
from shardkit.stopping import POLL_SECONDS, Stopped

__all__ = ["AHEAD_BLOCKS", "AnnounceAhead", "Lacking", "MappedShards", "MAX_MAPPED_SHARDS", "NodeResidency"]

logger = logging.getLogger(__name__)

#: Page ranges populated per call: a stopped run stops between two (a block of small records is
#: millions of records, and a cold read of its pages takes seconds).
POPULATE_RANGES = 1024
#: Datasets of more shards keep the copy in node-shared memory: the assembler looks every batch up
#: in each shard's part of a block.
MAX_MAPPED_SHARDS = 256
#: Blocks announced beyond the one the reader populates (:class:`AnnounceAhead`): the device's
#: queue holds the next blocks' requests while the reader waits for one block's pages, maps them and
#: hands the block over, and blocks complete in the order the consumer takes them.
AHEAD_BLOCKS = 2


class NodeResidency(Protocol):
    """Which records some process of the node made resident (one flag a record, node-shared: the
    static cache's :meth:`~shardkit.tiers.static_cache.StaticCache.filled` and ``publish``)."""

    def filled(self, rows: np.ndarray) -> np.ndarray:
        """Which of records ``rows`` were made resident."""
        ...

    def publish(self, rows: np.ndarray) -> None:
        """Records ``rows`` are resident now."""
        ...


@dataclass(frozen=True)
class Lacking:
    """What :meth:`MappedShards.announce` announced: ``(shard, keys, rows)`` of the records that
    this process had not made resident, each shard's ascending."""

    parts: list[tuple[int, np.ndarray, np.ndarray]]


class MappedShards:
    """Every record of ``payload`` as read-only views of its shard files (:meth:`open`). A block's
    records are made resident by :meth:`populate` on the reader thread (read from storage where the
    page cache lacks them, counted as disk reads) and copied into batches from the views
    (:meth:`copies`), so the cache allocates no memory of its own and copies nothing to fill: with
    the files in the page cache the first epoch costs what a later one does. It lives as long as
    the static cache (:attr:`StaticCache.mapped`), across the sampler's runs."""

    def __init__(self, payload: PayloadArray, maps: list[tuple[MappedFile, np.ndarray]]) -> None:
        self._locations = [payload.shard_location(i) for i in range(len(maps))]
        #: Each shard's mapping; its ``resident`` units are records (not asked of storage again).
        self._files = [f for f, _ in maps]
        self.views = [v for _, v in maps]
        self.records_per_shard = int(payload.records_per_shard)
        self.record_nbytes = int(payload.record_nbytes)

    @classmethod
    def open(cls, payload: PayloadArray) -> MappedShards | None:
        """Map every shard of ``payload``; ``None`` when one cannot be (remote, compressed, not the
        fixed-size layout) or there are more than :data:`MAX_MAPPED_SHARDS`."""
        if type(payload) is not PayloadArray or payload.codec is not None or not 0 < len(payload.shards) <= MAX_MAPPED_SHARDS:
            return None
        maps: list[tuple[MappedFile, np.ndarray]] = []
        for i in range(len(payload.shards)):
            got = payload.map_shard(i)
            if got is None:
                for f, _ in maps:
                    f.close()
                return None
            maps.append(got)
        return cls(payload, maps)

    def _lacking(self, keys: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(shard, keys, rows)`` of the records ``keys`` this process has not made resident, each
        shard's ascending."""
        rps = self.records_per_shard
        todo = distinct_sorted(keys)
        parts = []
        for part in np.split(todo, np.flatnonzero(np.diff(todo // rps)) + 1) if todo.size else ():
            i = int(part[0]) // rps
            parts.append((i, part, part - i * rps))
        return self._still_lacking(parts)

    def _still_lacking(self, parts: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``parts`` (``(shard, keys, rows)``) without the records this process made resident: those
        of earlier blocks, and those made resident since ``parts`` were announced."""
        out = []
        for i, part, rows in parts:
            lacking = ~self._files[i].resident[rows]
            if not lacking.all():
                part, rows = part[lacking], rows[lacking]
            if rows.size:
                out.append((i, part, rows))
        return out

    def _ranges(self, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Page ranges ``[starts, ends)`` of rows ``rows`` of shard ``i`` and the first row of each."""
        starts, ends, firsts = reserve_ranges(rows, 0, self.record_nbytes)
        return starts, np.minimum(ends, len(self._files[i])), firsts

    def announce(self, keys: np.ndarray) -> Lacking:
        """Have the kernel start reading the pages of records ``keys`` that this process has not made
        resident (:meth:`MappedFile.announce`) and return what it announced, for :meth:`populate` of
        the same keys, once the reads are queued (on a busy device: once its queue had room for
        them, which is why :class:`AnnounceAhead` calls it off the reader's thread)."""
        parts = self._lacking(keys)
        for i, _, rows in parts:
            self._files[i].announce(*self._ranges(i, rows)[:2])
        return Lacking(parts)

    def populate(
        self,
        keys: np.ndarray,
        stats: ReadStats,
        stop: threading.Event | None = None,
        node: NodeResidency | None = None,
        announced: Lacking | None = None,
    ) -> None:
        """Map the pages of records ``keys`` this process never made resident, each shard's in
        ascending ranges (:class:`~shardkit.formats.mapping.MappedFile`: every range of the block
        announced, unless :meth:`announce` of these keys did (``announced``, what it returned), then
        populated; the kernel reads what the page cache lacks); raises :class:`Stopped` between two pieces once ``stop``
        is set.

        ``node`` is the node's record of what is resident (the static cache's flags, row = key):
        only records no process of the node made resident are counted in ``stats`` as read (their
        bytes, what a read asks for: the kernel reads whole pages for any read) and published to it
        once populated; the others are in the page cache, and populating them only maps them here."""
        parts = self._lacking(keys) if announced is None else self._still_lacking(announced.parts)
        if not parts:
            return
        todo = np.concatenate([part for _, part, _ in parts]) if len(parts) > 1 else parts[0][1]
        fresh = np.ones(todo.size, dtype=bool) if node is None else ~node.filled(todo)
        pieces = []
        at = 0
        for i, part, rows in parts:
            new, at = fresh[at : at + part.size], at + part.size
            starts, ends, firsts = self._ranges(i, rows)
            if announced is None:
                self._files[i].announce(starts, ends)
            pieces.append((part, new, i, rows, starts, ends, firsts))
        for part, new, i, rows, starts, ends, firsts in pieces:
            f = self._files[i]
            counted = np.concatenate(([0], np.cumsum(new)))  # fresh records before each row
            for c in range(0, starts.size, POPULATE_RANGES):
                if stop is not None and stop.is_set():
                    raise Stopped()
                s, e = starts[c : c + POPULATE_RANGES], ends[c : c + POPULATE_RANGES]
                f.populate(s, e)
                upto = np.searchsorted(rows, firsts[c + POPULATE_RANGES]) if c + POPULATE_RANGES < firsts.size else rows.size
                records = int(counted[upto] - counted[np.searchsorted(rows, firsts[c])])
                if records:
                    stats.add(self._locations[i], int(s[0]), records * self.record_nbytes)
            f.resident[rows] = True
            if node is not None and counted[-1]:
                node.publish(part[new])
        stats.add_records(int(np.count_nonzero(fresh)))

    def copies(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(positions, view, rows)`` per shard a block's ``keys`` touch: positions (ascending) of
        ``keys`` whose records are rows ``rows`` of shard view ``view``."""
        rps = self.records_per_shard
        shard = keys // rps
        order = np.argsort(shard, kind="stable")
        counts = np.bincount(shard, minlength=len(self.views))
        out = []
        at = 0
        for i in np.flatnonzero(counts).tolist():
            pos = order[at : at + int(counts[i])]
            at += int(counts[i])
            out.append((pos, self.views[i], keys[pos] - i * rps))
        return out

    def close(self) -> None:
        """Let go of the mappings (views still alive keep theirs)."""
        self.views = []
        for f in self._files:
            f.close()  # a batch's view still alive keeps its mapping until it goes
        self._files = []


class AnnounceAhead:
    """A pass's blocks announced in order (:meth:`MappedShards.announce`) on a thread of its own, up
    to :data:`AHEAD_BLOCKS` beyond the block the reader populates. ``MADV_WILLNEED`` returns once
    the reads are queued, which on a busy device takes about as long as the blocks queued before
    take to arrive: off the reader's thread, that wait neither holds a block back from the consumer
    nor leaves the device idle while the reader maps a block and hands it over. Each block is
    announced with its own records only, so blocks complete in the order the consumer takes them
    and the assembler copies one while the device reads the next."""

    def __init__(self, mapped: MappedShards) -> None:
        self._mapped = mapped
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-announce")
        self._keys_of: Callable[[int], np.ndarray] | None = None
        self._count = 0
        self._next = 0
        self._pending: dict[int, tuple[np.ndarray, Future[Lacking]]] = {}

    def start_pass(self, keys_of: Callable[[int], np.ndarray], count: int) -> None:
        """A pass of ``count`` blocks, block ``i``'s keys ``keys_of(i)`` (called on the reader's
        thread); what an earlier pass left announced is dropped (its pages stay in the page cache)."""
        self._keys_of, self._count, self._next = keys_of, count, 0
        self._pending.clear()

    def take(self, i: int, stop: threading.Event) -> tuple[np.ndarray, Lacking]:
        """Block ``i``'s keys and what was announced of them, once its reads are queued; blocks up to
        ``i + AHEAD_BLOCKS`` are handed to the thread first. Raises :class:`Stopped` once ``stop``
        is set, and the thread's error if the announcement failed."""
        assert self._keys_of is not None
        for j in range(max(self._next, i), min(self._count, i + 1 + AHEAD_BLOCKS)):
            keys = self._keys_of(j)
            self._pending[j] = (keys, self._pool.submit(self._mapped.announce, keys))
            self._next = j + 1
        keys, done = self._pending.pop(i)
        while True:
            if stop.is_set():
                raise Stopped()
            try:
                return keys, done.result(timeout=POLL_SECONDS)
            except TimeoutError:
                continue

    def close(self) -> None:
        """Drop what was not taken; waits for an announcement in progress (it ends once queued)."""
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
