"""A fixed-size shard's index checked a page at a time, as its records are first read.

A local uncompressed dataset shard must hold exactly the fixed-size layout's index (record ``j`` at
``j * record_nbytes``; :meth:`~shardkit.formats.index.ShardIndex.dense`), so the reader computes
offsets and only has to check that the file says the same. Reading and comparing a whole index at a
shard's first read costs 16 bytes a record of the shard: at 10^8 records of 32 bytes the first
block touches every shard, and its start-up read 1.6 GB of indexes for 8,192 records (issue #34).
:class:`DenseIndexCheck` instead checks the shard's size, stored and recorded crc32c and its tail at
the first read (a few bytes), and then the index entries of the records each read asks for, one
page (:data:`PIECE_ENTRIES` entries) at a time, each page once: no record is delivered before its
own entry was compared, and an epoch reads each index once. A page that differs sends the caller
to the full decode, which names what is wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from shardkit.formats.index import extend_crc32c
from shardkit.formats.spec import EMPTY_ENTRY

__all__ = ["PIECE_ENTRIES", "WHOLE_INDEX_ENTRIES", "DenseIndexCheck", "dense_entries", "dense_index_crc32c"]

#: Index entries compared as one piece: 256 entries of 16 bytes, one 4 KiB page of the index.
PIECE_ENTRIES = 256
#: Entries read and compared per request at most (1 MiB of index: bounded temporaries).
_RUN_ENTRIES = 1 << 16
#: Indexes of at most this many entries (64 KiB) are read whole at the shard's first read, in one
#: request with the records' tail and the crc32c: a page at a time saves nothing on them.
WHOLE_INDEX_ENTRIES = 1 << 12
#: Pages not asked for (or compared before) that are read and compared anyway to join two requests
#: (a 4 KiB page from the page cache costs less than one more system call and its Python).
_GAP_PAGES = 4
#: A read that asks for at least 1 / _ALL_LEFT of the pages not compared yet compares all of them:
#: a dense block's pages are long spans, not a request per hole the first blocks left.
_ALL_LEFT = 4


def dense_entries(a: int, b: int, count: int, record_nbytes: int) -> np.ndarray:
    """Entries ``[a, b)`` of the fixed-size layout's index of a shard of ``count`` records, as the
    little-endian words ``offset, nbytes`` of each (slots past ``count`` empty)."""
    out = np.full((max(0, b - a), 2), EMPTY_ENTRY, dtype="<u8")
    live = min(b, count) - a
    if live > 0:
        out[:live, 0] = np.arange(a, a + live, dtype=np.uint64) * np.uint64(record_nbytes)
        out[:live, 1] = record_nbytes
    return out.reshape(-1)


@functools.lru_cache(maxsize=16)
def dense_index_crc32c(count: int, capacity: int, record_nbytes: int) -> int:
    """crc32c of the fixed-size layout's index entries (what its trailer and the metadata record),
    computed in pieces without the whole index in memory; a dataset has at most two record counts."""
    crc = 0
    for a in range(0, capacity, _RUN_ENTRIES):
        crc = extend_crc32c(crc, dense_entries(a, min(capacity, a + _RUN_ENTRIES), count, record_nbytes))
    return crc


class DenseIndexCheck:
    """The pages of one shard's index already found equal to the fixed-size layout's.

    ``read(buffer, offset)`` fills ``buffer`` with the shard's bytes at ``offset`` (counted by the
    reader); ``index_offset`` is where the index starts in the file. Not thread-safe: the reader
    calls it under its check lock."""

    def __init__(self, capacity: int, count: int, record_nbytes: int, index_offset: int,
                 read: Callable[[memoryview, int], None]) -> None:  # fmt: skip
        self.capacity, self.count, self.record_nbytes = int(capacity), int(count), int(record_nbytes)
        self.index_offset = int(index_offset)
        self._read = read
        self._checked = np.zeros(-(-self.capacity // PIECE_ENTRIES), dtype=bool)
        self._left = int(self._checked.size)

    def compare_whole(self, found: np.ndarray) -> bool:
        """Compare the whole index, ``found`` (its entries as little-endian words, read by the caller
        in the request that reads the shard's tail), and mark every page when it is the layout's."""
        if not np.array_equal(found, dense_entries(0, self.capacity, self.count, self.record_nbytes)):
            return False
        self._checked[:] = True
        self._left = 0
        return True

    @property
    def done(self) -> bool:
        """Every page of the index was compared: the whole index is the fixed-size layout's."""
        return self._left == 0

    def check(self, local: np.ndarray | None) -> bool:
        """Compare the index pages holding the entries of records ``local`` (shard-local, ascending;
        ``None``: every record, with no array of them) that were not compared yet; False at the
        first group of pages that differs (nothing is marked then). Pages at most :data:`_GAP_PAGES`
        apart are read as one span (the pages between are compared too, again if they were before: a
        page is read at most twice), and spans are compared in groups of about :data:`_RUN_ENTRIES`
        entries, one numpy comparison each: a sparse first block asks for one page per record."""
        if self._left == 0:
            return True
        if local is None:
            todo = np.flatnonzero(~self._checked)
        else:
            pages = np.asarray(local, dtype=np.int64) // PIECE_ENTRIES
            # ``local`` is ascending: its distinct pages are where the page changes (no sort, no hash).
            pieces = pages[np.flatnonzero(np.diff(pages, prepend=np.int64(-1)))]
            todo = pieces[~self._checked[pieces]]
            if not todo.size:
                return True
            if todo.size * _ALL_LEFT >= self._left:  # a dense block: every page left, in long spans
                todo = np.flatnonzero(~self._checked)
        run_pages = _RUN_ENTRIES // PIECE_ENTRIES
        cut = np.flatnonzero(np.diff(todo) > _GAP_PAGES + 1) + 1
        first = todo[np.concatenate(([0], cut))]
        last = todo[np.concatenate((cut - 1, [todo.size - 1]))] + 1
        # Spans of at most run_pages pages, grouped by where they start (a group: under 2 x run_pages).
        size = last - first
        parts = -(-size // run_pages)
        first = np.repeat(first, parts) + run_pages * (np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts))
        last = np.minimum(first + run_pages, np.repeat(last, parts))
        group = np.cumsum(last - first) // run_pages
        bounds = np.flatnonzero(np.diff(group)) + 1
        for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), first.size]):
            if not self._compare(first[a:b], last[a:b]):
                return False
        for a, b in zip(first.tolist(), last.tolist()):
            self._checked[a:b] = True
        self._left = int(self._checked.size - np.count_nonzero(self._checked))
        return True

    def _compare(self, first: np.ndarray, last: np.ndarray) -> bool:
        """Read the index pages ``[first[k], last[k])`` (one request each) and compare them with the
        fixed-size layout's: many short spans (a sparse block) in one vectorised step, a few long
        ones (a dense block) span by span against :func:`_offset_steps` (no entry-sized temporaries)."""
        lo = np.minimum(first * PIECE_ENTRIES, self.capacity)
        hi = np.minimum(last * PIECE_ENTRIES, self.capacity)
        n = hi - lo
        found = np.empty((int(n.sum()), 2), dtype="<u8")
        raw = found.view(np.uint8).reshape(-1).data
        at = 0
        for a, k in zip(lo.tolist(), n.tolist()):
            self._read(raw[16 * at : 16 * (at + k)], self.index_offset + 16 * a)
            at += k
        if found.shape[0] < _SPAN_ENTRIES * lo.size:
            entry = np.arange(found.shape[0], dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)
            live = entry < self.count
            want = np.where(live, entry.astype(np.uint64) * np.uint64(self.record_nbytes), EMPTY_ENTRY)
            if not np.array_equal(found[:, 0], want):
                return False
            return bool(np.array_equal(found[:, 1], np.where(live, np.uint64(self.record_nbytes), EMPTY_ENTRY)))
        rec = np.uint64(self.record_nbytes)
        at = 0
        for a, k in zip(lo.tolist(), n.tolist()):
            span, at = found[at : at + k], at + k
            live = max(0, min(k, self.count - a))
            for c in range(0, live, _RUN_ENTRIES):  # entry a + c + j at (a + c + j) * rec, of rec bytes
                part = span[c : min(live, c + _RUN_ENTRIES)]
                steps = _offset_steps(self.record_nbytes)[: part.shape[0]]
                if not np.array_equal(part[:, 0] - np.uint64(a + c) * rec, steps) or not bool(np.all(part[:, 1] == rec)):
                    return False
            if live < k and not bool(np.all(span[live:] == np.uint64(EMPTY_ENTRY))):
                return False
        return True


#: Entries a span must have on average to be compared span by span (else all spans at once).
_SPAN_ENTRIES = 4 * PIECE_ENTRIES


@functools.lru_cache(maxsize=4)
def _offset_steps(record_nbytes: int) -> np.ndarray:
    """``j * record_nbytes`` for ``j`` in ``range(_RUN_ENTRIES)``: the layout's offsets from a span's first (512 KiB)."""
    steps = np.arange(_RUN_ENTRIES, dtype=np.uint64) * np.uint64(record_nbytes)
    steps.flags.writeable = False
    return steps
