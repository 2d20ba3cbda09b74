"""The static cache of a dataset it holds whole, as the shard files' own pages: a local dataset of
fixed-size records is mapped, and the page cache is the cache (docs/design.md §4, *Static cache*).
"""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardkit.formats import PayloadArray
from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.mapping import MappedFile, reserve_ranges
from shardkit.formats.reader import ReadStats
from shardkit.stopping import Stopped

__all__ = ["Lacking", "MappedShards", "MAX_MAPPED_SHARDS", "NodeResidency"]

logger = logging.getLogger(__name__)

#: Page ranges populated per call: a stopped run stops between two (a block of small records is
#: millions of records, and a cold read of its pages takes seconds).
POPULATE_RANGES = 1024
#: Datasets of more shards keep the copy in node-shared memory: the assembler looks every batch up
#: in each shard's part of a block.
MAX_MAPPED_SHARDS = 256
#: A block reads *through* a gap of at most this many bytes between two of its records in a shard
#: (:meth:`MappedShards.announce`): the gap's records are made resident with it, for the blocks
#: after, so the device gets runs of records where a sparse block's records were one request each.
#: Every record is read in the first epoch anyway, so this reads no byte more per epoch; a longer
#: gap would make a block wait for more of the later blocks' bytes before its first batch.
READ_THROUGH_BYTES = 3 << 20


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

    def _lacking(self, keys: np.ndarray, through: bool = False) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(shard, keys, rows)`` of the records ``keys`` this process has not made resident, each
        shard's ascending; ``through``: with those of the gaps read through (:meth:`_through`)."""
        rps = self.records_per_shard
        todo = distinct_sorted(keys)
        parts = []
        for part in np.split(todo, np.flatnonzero(np.diff(todo // rps)) + 1) if todo.size else ():
            i = int(part[0]) // rps
            rows = part - i * rps
            if through:
                rows = self._through(rows)
                part = rows + i * rps
            parts.append((i, part, rows))
        return self._still_lacking(parts)

    def _through(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of a shard (distinct, ascending) and those of every gap between two of them
        of at most :data:`READ_THROUGH_BYTES`, ascending. Records under a page are left as they are:
        their blocks share pages already, and a gap of small records is many rows to list."""
        rec = self.record_nbytes
        if rows.size < 2 or rec < mmap.PAGESIZE:
            return rows
        gaps = np.diff(rows) - 1  # records between two neighbours
        fill = np.flatnonzero((gaps > 0) & (gaps <= READ_THROUGH_BYTES // rec))
        if not fill.size:
            return rows
        lengths = gaps[fill]
        heads = np.cumsum(lengths) - lengths  # where each gap's rows start in ``inside``
        inside = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(rows[fill] + 1 - heads, lengths)
        return np.sort(np.concatenate((rows, inside)))

    def _still_lacking(self, parts: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``parts`` (``(shard, keys, rows)``) without the records this process made resident: those
        of earlier blocks, and those a gap the block before read through held since ``parts`` were
        announced."""
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

    def announce(self, keys: np.ndarray, through: bool = True) -> Lacking:
        """Have the kernel start reading the pages of records ``keys`` that this process has not made
        resident (:meth:`MappedFile.announce`) and return at once what it announced, for
        :meth:`populate` of the same keys: the reader announces the next block before it waits for
        this one's pages, so the device does not idle between two blocks. ``through``: the records
        of each gap of at most :data:`READ_THROUGH_BYTES` between two of them are announced (and
        populated) with them."""
        parts = self._lacking(keys, through)
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
        through: bool = True,
    ) -> None:
        """Map the pages of records ``keys`` this process never made resident, each shard's in
        ascending ranges (:class:`~shardkit.formats.mapping.MappedFile`: every range of the block
        announced, unless :meth:`announce` of these keys did (``announced``, what it returned), then
        populated; the kernel reads what the page cache lacks); raises :class:`Stopped` between two pieces once ``stop``
        is set. ``through`` (unless ``announced``, which says what to populate): the gaps of at most
        :data:`READ_THROUGH_BYTES` between the records too, as :meth:`announce` does; the run's
        first block reads its own records only, for its first batch.

        ``node`` is the node's record of what is resident (the static cache's flags, row = key):
        only records no process of the node made resident are counted in ``stats`` as read (their
        bytes, what a read asks for: the kernel reads whole pages for any read) and published to it
        once populated; the others are in the page cache, and populating them only maps them here."""
        parts = self._lacking(keys, through) if announced is None else self._still_lacking(announced.parts)
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
