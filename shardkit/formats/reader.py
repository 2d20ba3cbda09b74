"""Reading payload shards with ``pread``/``preadv`` straight into preallocated numpy buffers.

:meth:`PayloadArray.read_into` reads records in any order, shard by shard in ascending offsets, close
records coalesced, every byte copied once to its destination row: a block of a random permutation
costs what its records in storage order cost. The read path: docs/design.md §3 (*The hot path*).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import (
    ChecksumError,
    ConfigError,
    CorruptIndexError,
    CorruptShardError,
    MissingShardError,
    NotADatasetError,
    SchemaError,
    TruncatedShardError,
    UnsafePathError,
)
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest
from shardkit.formats.codecs import RecordCodec, codec_from_zarr, decode_error
from shardkit.formats.decode_threads import DecodeJob, DecodeThreads, finish_decodes, wait_decodes
from shardkit.formats.dense_index import WHOLE_INDEX_ENTRIES, DenseIndexCheck, dense_index_crc32c
from shardkit.formats.index import ShardIndex, crc32c_of
from shardkit.formats.mapping import MADV_POPULATE_WRITE, MappedFile, libc_madvise
from shardkit.formats.metadata import read_json
from shardkit.formats.paths import resolve_inside
from shardkit.formats.spec import (
    CHECKSUM_NBYTES,
    MAX_NDIM,
    MAX_RECORDS_PER_SHARD,
    ZARR_JSON,
    FieldSpec,
    ShardInfo,
    chunk_key,
    index_nbytes,
)
from shardkit.formats.versions import older_copy, read_document
from shardkit.processes import renew_locks_after_fork
from shardkit.stopping import Stopped
from shardkit.stores import LocalStore
from shardkit.stores.local import open_regular

__all__ = ["ReadStats", "PayloadArray", "ShardedLayout", "Destination", "aligned_empty", "DEFAULT_GAP_BYTES", "BUFFER_ALIGNMENT",
           "SCATTER_MIN_BYTES", "SortScratch", "SortedRequest"]

logger = logging.getLogger(__name__)

#: Gaps up to this many bytes between wanted records are read (and discarded) rather than skipped:
#: about what one more request costs on a virtual disk (docs/design.md §3).
DEFAULT_GAP_BYTES = 64 * 1024
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: Records at least this large are read straight into their destination rows (one ``iovec`` each);
#: smaller ones through a bounce buffer, since an ``iovec`` costs more Python time than copying them.
SCATTER_MIN_BYTES = 16 * 1024
#: Reading this many bytes more (and copying them) costs about what one more ``iovec`` costs in
#: Python: small records whose run reads at most this much per record go through the bounce buffer.
IOVEC_BYTES = 4096
#: Distinct records planned at once by :meth:`PayloadArray.read_into` (a larger request is planned
#: and read in pieces of ascending keys): bounds the plan's per-record arrays (about 100 bytes a record).
PLAN_RECORDS = 1 << 16
#: Size of the bounce buffer that small records are read through, per run.
BOUNCE_BYTES = 4 << 20
#: Pages of a shard's span asked whether they are in the page cache before a staged block's records are
#: gathered from the shard's mapping rather than read (:meth:`PayloadArray._cached_map`).
CACHED_SAMPLE = 16
#: Compressed records one decode job takes at most (see :class:`_DecodeJobs`): the hand-off (~20 µs a
#: job) and the job's set-up stay small against decoding (~300 µs per 224x224 JPEG), while the last
#: job of a read holds back the others by a few milliseconds at most.
DECODE_JOB_RECORDS = 16
#: Shard files one reader maps at most for its compressed records (see :meth:`PayloadArray._mapped_runs`;
#: the others are read with ``preadv``): a mapping is one of the process's ``vm.max_map_count``
#: (65,530 by default) areas, which numpy's and malloc's large allocations need too.
MAX_MAPPED_FILES = 1024
#: Alignment of every destination buffer :meth:`PayloadArray.empty` allocates: a page, so a buffer
#: can take ``O_DIRECT`` reads and TensorFlow (which wants 64 bytes) shares it without a copy.
BUFFER_ALIGNMENT = 4096


@dataclass
class ReadStats:
    """Counters of one reader (one tier): what was asked of storage; ``trace`` (off by default) records
    every request as ``(file, offset, nbytes)`` so tests can prove the access pattern."""

    bytes_read: int = 0
    read_calls: int = 0
    records: int = 0
    trace: list[tuple[str, int, int]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        renew_locks_after_fork(self, "_lock")  # counted from reader threads a fork may catch

    def add(self, path: str, offset: int, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_calls += 1
            if self.trace is not None:
                self.trace.append((path, offset, nbytes))

    def add_runs(self, path: str, starts: np.ndarray, ends: np.ndarray) -> None:
        """Runs ``[starts[k], ends[k])`` of one file counted at once, each one request as :meth:`add` counts it."""
        with self._lock:
            self.bytes_read += int((ends - starts).sum())
            self.read_calls += int(starts.size)
            if self.trace is not None:
                self.trace.extend(zip([path] * starts.size, starts.tolist(), (ends - starts).tolist()))

    def add_records(self, n: int) -> None:
        with self._lock:
            self.records += n

    def as_dict(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read, "read_calls": self.read_calls, "records": self.records}


@dataclass(frozen=True)
class ShardedLayout:
    """What a reader needs from a sharded payload array's ``zarr.json``: shape ``(N, *record_shape)``,
    little-endian dtype, records per shard S, per-record codec (``None``: fixed-size layout), the fill
    value a record never written reads as, and the chunk key separator."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    records_per_shard: int
    codec: RecordCodec | None
    fill_value: Any
    separator: str

    @classmethod
    def parse(cls, doc: dict[str, Any], where: str) -> ShardedLayout:
        """Check that ``doc`` is a shardkit-compatible sharded zarr v3 array and extract its layout,
        every size bounded (at most 2**62 records, record bytes, records per shard) before use."""
        if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
            raise NotADatasetError(f"{where}: expected zarr v3 array metadata")
        shape = jv.shape(jv.member(doc, "shape", where), "shape", where, max_ndim=MAX_NDIM + 1, lo=0, hi=2**62)
        if 0 in shape[1:]:
            raise NotADatasetError(f"{where}: record dimensions must be positive, found shape {list(shape)}")
        if not shape:
            raise NotADatasetError(f"{where}: expected an array with a record axis, found a scalar")
        data_type = jv.string(jv.member(doc, "data_type", where), "data_type", where)
        try:  # numeric, one record within the record-size bound
            dtype = np.dtype(FieldSpec(shape[1:], data_type).dtype).newbyteorder("<")
        except SchemaError as exc:
            raise NotADatasetError(f"{where}: {exc}") from None
        grid = jv.mapping(jv.member(doc, "chunk_grid", where), "chunk_grid", where)
        if grid.get("name") != "regular":
            raise NotADatasetError(f"{where}: expected a 'regular' chunk grid, found {grid.get('name')!r}")
        grid_conf = jv.mapping(jv.member(grid, "configuration", where), "chunk_grid.configuration", where)
        shard_shape = jv.shape(jv.member(grid_conf, "chunk_shape", where), "chunk_shape", where, max_ndim=MAX_NDIM)
        codecs = jv.array(doc.get("codecs", []), "codecs", where)
        if len(codecs) != 1 or not isinstance(codecs[0], dict) or codecs[0].get("name") != "sharding_indexed":
            raise NotADatasetError(f"{where}: expected a single 'sharding_indexed' codec, found {codecs}"[:400])
        conf = jv.mapping(jv.member(codecs[0], "configuration", where), "sharding_indexed.configuration", where)
        inner = jv.shape(jv.member(conf, "chunk_shape", where), "inner chunk_shape", where, max_ndim=MAX_NDIM)
        if inner != (1, *shape[1:]) or shard_shape[1:] != shape[1:]:
            raise NotADatasetError(
                f"{where}: expected one record per inner chunk {(1, *shape[1:])} and whole records per shard, "
                f"found inner chunk {inner} in shard {shard_shape}"
            )
        if not 1 <= shard_shape[0] <= MAX_RECORDS_PER_SHARD:
            raise NotADatasetError(f"{where}: expected 1 to {MAX_RECORDS_PER_SHARD} records per shard, found {shard_shape[0]}")
        index_codecs = [c.get("name") if isinstance(c, dict) else c for c in jv.array(conf.get("index_codecs", []), "index_codecs", where)]
        if index_codecs != ["bytes", "crc32c"]:
            raise NotADatasetError(f"{where}: expected index codecs [bytes, crc32c], found {index_codecs}")
        codec = codec_from_zarr(conf.get("codecs"), where=where)
        encoding = jv.mapping(doc.get("chunk_key_encoding", {"name": "default"}), "chunk_key_encoding", where)
        if encoding.get("name") != "default":
            raise NotADatasetError(f"{where}: expected the 'default' chunk key encoding, found {encoding}")
        sep = jv.mapping(encoding.get("configuration") or {}, "chunk_key_encoding.configuration", where).get("separator", "/")
        if sep not in ("/", "."):
            raise NotADatasetError(f"{where}: chunk key separator must be '/' or '.', found {sep!r}")
        if conf.get("index_location", "end") != "end":
            raise NotADatasetError(f"{where}: expected index_location 'end', found {conf['index_location']!r}")
        fill = _fill_value(doc.get("fill_value", 0), dtype, where)
        return cls(shape, dtype, shard_shape[0], codec, fill, sep)


def _fill_value(value: Any, dtype: np.dtype[Any], where: str) -> Any:
    """zarr v3 fill value: a number, a bool, or one of the special float strings."""
    if isinstance(value, (bool, int, float)) or (dtype.kind in "fc" and value in ("NaN", "Infinity", "-Infinity")):
        try:
            return np.array(value).astype(dtype).item()
        except (OverflowError, ValueError):
            pass
    raise NotADatasetError(f"{where}: fill_value {value!r} does not fit data type {dtype}")


@dataclass(frozen=True, eq=False)
class _Plan:
    """One read, in read order (by shard, then ascending offset): record ``j`` is at ``offs[j]``
    (``sizes[j]`` bytes) of shard ``shard[j]`` and goes to row ``row[j]`` of destination buffer
    ``which[j]``; ``gap[j]`` is the distance from the previous record's end (within a shard), and
    runs (one request each) start at ``run_starts``. ``files`` maps a shard to its open file and name
    when the plan spans several arrays (:func:`read_distinct_parts`); ``None``: the reader's own shards."""

    shard: np.ndarray
    offs: np.ndarray
    sizes: np.ndarray
    which: np.ndarray
    row: np.ndarray
    new_shard: np.ndarray
    gap: np.ndarray
    run_starts: np.ndarray
    files: Callable[[int], tuple[int, str]] | None = None
    #: Every offset is a whole number of records (the fixed-size layout): a bounce piece's records
    #: are rows of it without a check.
    grid: bool = False

    @property
    def size(self) -> int:
        return int(self.offs.size)

    @property
    def num_runs(self) -> int:
        return int(self.run_starts.size)

    def runs(self) -> list[tuple[int, int]]:
        """``[a, b)`` index range of every run."""
        starts = self.run_starts.tolist()
        return list(zip(starts, [*starts[1:], self.size]))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(start, end)`` byte offsets of every run, gaps included (what the run reads)."""
        last = np.append(self.run_starts[1:], self.size) - 1
        return self.offs[self.run_starts], self.offs[last] + self.sizes[last]

    def dense_runs(self) -> np.ndarray:
        """Runs whose wanted records fill at least half of the bytes they read, or that read at most
        :data:`IOVEC_BYTES` per wanted record (for each run): copying those bytes costs less than an
        ``iovec`` per record."""
        start, end = self.spans()
        if not self.size:
            return np.zeros(0, dtype=bool)
        wanted: np.ndarray = np.add.reduceat(self.sizes, self.run_starts)
        count = np.diff(np.append(self.run_starts, self.size))
        dense: np.ndarray = (2 * wanted >= end - start) | (end - start <= count * IOVEC_BYTES)
        return dense

    def as_runs(self, location: Callable[[int], str]) -> list[_Run]:
        """The plan as one :class:`_Run` per request, ``pos`` indexing the plan (see :class:`_Rows`)."""
        out = []
        for a, b in self.runs():
            i = int(self.shard[a])
            out.append(_Run(i, location(i), self.offs[a:b], self.sizes[a:b], np.arange(a, b, dtype=np.int64)))
        return out


@dataclass(frozen=True)
class _Run:
    """Records of one shard read by one request; record ``j`` goes to ``rows[pos[j]]``."""

    shard: int
    path: str
    offs: np.ndarray
    sizes: np.ndarray
    pos: np.ndarray


class _Rows:
    """The destination row of every record of a plan, by the record's index in it: ``rows[j]`` is a
    writable uint8 view of record ``j``'s row, and ``rows[j] = data`` writes it (for readers that
    scatter record by record, such as the object-store reader)."""

    def __init__(self, arrays: list[np.ndarray], plan: _Plan) -> None:
        self.arrays, self.which, self.row = arrays, plan.which, plan.row
        #: Decodes started on the decode threads for these rows (see :meth:`PayloadArray._decode_records`):
        #: the read that owns the rows waits for them (:func:`finish_decodes`) before returning.
        self.decodes: list[DecodeJob] = []

    def __getitem__(self, j: int) -> np.ndarray:
        out: np.ndarray = self.arrays[int(self.which[j])][int(self.row[j])]
        return out

    def __setitem__(self, j: int, value: Any) -> None:
        self.arrays[int(self.which[j])][int(self.row[j])] = value


#: One run's records for a decoder: ``(shard, start, data, offs, sizes, which, row)`` (see
#: :meth:`PayloadArray._decode_records`).
_Segment = tuple[int, int, memoryview, list[int], list[int], list[int], list[int]]


class _DecodeJobs:
    """The ``total`` records one read hands to the decode threads, grouped into jobs across runs: a
    run of a sparse read holds a few records, and a job (one hand-off, one loop) per run cost more
    than its records' Python. Jobs shrink as the read nears its end (guided: at most the records
    still to come over twice the decoders, and :data:`DECODE_JOB_RECORDS`), so the decoders finish
    together instead of one idling through the other's last job; a job goes at once while a decoder
    would otherwise idle (fewer jobs pending than decoders), so decoding starts with the first run.
    Without decode threads every run is decoded when it is added."""

    def __init__(self, array: PayloadArray, arrays: Sequence[np.ndarray], jobs: list[DecodeJob], total: int) -> None:
        self.array = array
        self.jobs = jobs
        self.pool = array._decode_pool()
        self.targets = array._decode_targets(arrays)
        self.workers = max(1, array.decode_workers)
        self.segments: list[_Segment] = []
        self.count = 0
        #: Records not yet in a submitted job (those in :attr:`segments` and those not yet added).
        self.remaining = int(total)
        self._pending = 0
        self._lock = threading.Lock()

    def _job_records(self) -> int:
        return min(DECODE_JOB_RECORDS, max(1, -(-self.remaining // (2 * self.workers))))

    def add(self, i: int, start: int, data: memoryview, offs: list[int], sizes: list[int], which: list[int],
            row: list[int]) -> None:
        """Records ``data[offs[k] : offs[k] + sizes[k]]`` of shard ``i`` (``data`` starts at byte
        ``start``) for rows ``which[k]``, ``row[k]`` of the read's buffers."""
        if self.pool is None:
            self.array._decode_segments([(i, start, data, offs, sizes, which, row)], self.targets)
            return
        n, c = len(offs), 0
        while c < n:
            size = self._job_records()
            d = min(n, c + size - self.count)
            self.segments.append((i, start, data, offs[c:d], sizes[c:d], which[c:d], row[c:d]) if c or d < n
                                 else (i, start, data, offs, sizes, which, row))  # fmt: skip
            self.count += d - c
            c = d
            if self.count >= size or self._pending < self.workers:
                self.flush()

    def flush(self) -> None:
        """Hand over the records not yet in a job."""
        if self.segments:
            self._submit(self.segments)
            self.remaining -= self.count
            self.segments, self.count = [], 0

    def _submit(self, segments: list[_Segment]) -> None:
        assert self.pool is not None
        with self._lock:
            self._pending += 1
        self.jobs.append(self.pool.submit(functools.partial(self._run, segments)))

    def _run(self, segments: list[_Segment]) -> None:
        try:
            self.array._decode_segments(segments, self.targets)
        finally:
            with self._lock:
                self._pending -= 1


class ByteRows(list[np.ndarray]):
    """A request's destination buffers as ``[n, record_nbytes]`` uint8 rows, with each buffer's
    opaque-record view (:func:`_records`) made once per request, not once per buffer and piece (a
    block of small records is hundreds of batch buffers scattered into from every piece)."""

    def __init__(self, rows: list[np.ndarray]) -> None:
        super().__init__(rows)
        self._views: dict[int, np.ndarray] = {}

    def records(self, i: int) -> np.ndarray:
        """Buffer ``i`` as opaque records (cached for this request)."""
        view = self._views.get(i)
        if view is None:
            view = self._views[i] = _records(self[i])
        return view


def _scatter_rows(rows: list[np.ndarray], which: np.ndarray, row: np.ndarray, piece: np.ndarray,
                  take: np.ndarray | None = None) -> None:
    """``rows[which[j]][row[j]] = piece[take[j]]`` (``piece[j]`` without ``take``) for every ``j``:
    the records grouped by buffer with one stable sort (not one pass over ``which`` per buffer), then
    per buffer one ``np.take`` from ``piece`` and one ``np.put`` into the buffer. Those two copy a
    record in one ``memcpy`` (a fancy-indexed assignment of ``void`` records costs several times
    more per call and per record), and their temporaries are one buffer's share, so the piece's
    records are never copied into a piece-sized temporary first: each byte is copied once from
    the bounce buffer to a small temporary that stays in the CPU cache, then to its row."""
    if which.size == 0:
        return
    recs = rows.records if isinstance(rows, ByteRows) else (lambda i: _records(rows[i]))
    src_all = _records(piece)
    w0 = int(which[0])
    if np.all(which == w0):
        n, r0 = int(row.size), int(row[0])
        if int(row[-1]) - r0 == n - 1 and bool(np.all(np.diff(row) == 1)):
            # Consecutive rows (a staged block): one copy straight into them, no temporary.
            dst = recs(w0)[r0 : r0 + n]
            if take is None:
                dst[...] = src_all[:n]
            else:
                np.take(src_all, take, axis=0, out=dst, mode="clip")
            return
        np.put(recs(w0), row, src_all if take is None else np.take(src_all, take))
        return
    # A stable sort of small integers is a radix sort (several times faster than of int64).
    by = np.argsort(which.astype(np.int16) if len(rows) <= 1 << 15 else which, kind="stable")
    grouped, dst = which[by], row[by]
    src = by if take is None else take[by]  # the source record of each, in buffer order
    del by
    cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), grouped.size]):
        np.put(recs(int(grouped[lo])), dst[lo:hi], np.take(src_all, src[lo:hi]))


def gather_into(source: np.ndarray, keys: np.ndarray, dest: Destination) -> None:
    """Records ``source[keys[j]]`` (``source``: ``[n, record_nbytes]`` uint8 rows in memory, e.g. a
    mapped file) into ``dest``'s rows, as :meth:`PayloadArray.read_into` would read them from a file.
    A block's batches (:attr:`Destination.consecutive`) take one ``np.take`` per buffer straight into
    its consecutive rows, a single copy of each record; other destinations go through
    :func:`_scatter_rows`."""
    rows = SortedRequest.byte_rows(dest)
    src = _records(source)
    if dest.consecutive is None:
        _scatter_rows(rows, dest.which, dest.rows, source, keys)
        return
    offset, per = dest.consecutive
    j, n = 0, int(keys.size)
    while j < n:
        b, r = divmod(offset + j, per) if len(rows) > 1 else (0, offset + j)
        k = min(n - j, per - r) if len(rows) > 1 else n - j
        np.take(src, keys[j : j + k], axis=0, out=rows.records(b)[r : r + k], mode="clip")
        j += k


def byte_records(array: np.ndarray) -> np.ndarray:
    """A C-contiguous ``[n, *record_shape]`` array as ``n`` opaque records (see :func:`_records`)."""
    return _records(array.reshape(array.shape[0], -1).view(np.uint8))


def _records(rows: np.ndarray) -> np.ndarray:
    """``[n, nbytes]`` C-contiguous bytes as ``n`` opaque records (``void`` of ``nbytes``): numpy
    gathers and scatters those one block copy each, several times faster than rows of bytes."""
    if not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows)
    return rows.view(np.dtype((np.void, rows.shape[1]))).reshape(-1)


class SortScratch:
    """The arrays of one reader's request sort (:func:`_sorted_with_order`), one set per thread, kept
    at the largest request's size and reused: a block of small records then allocates no
    block-sized temporaries in steady state (freed ones stay in glibc's thread arenas, docs/design.md §4)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(packed, order, dup)`` of ``n`` elements (int64, positions as int32 below 2**31, bool)
        for this thread."""
        kept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = getattr(self._local, "arrays", None)
        if kept is None or kept[0].size < n:
            self._local.arrays = None  # the smaller arrays go before the larger ones are allocated
            kept = self._local.arrays = (np.empty(n, np.int64), np.empty(n, np.int32 if n < 1 << 31 else np.int64),
                                         np.empty(n, bool))  # fmt: skip
        return kept[0][:n], kept[1][:n], kept[2][:n]


def _sorted_with_order(keys: np.ndarray, bound: int, scratch: SortScratch | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(order, keys[order])`` with ``order`` the stable argsort of ``keys`` (in ``[0, bound)``).
    When key and position fit one int64, they are sorted packed together: a plain sort of integers
    (several times faster than a stable argsort, and no merge buffer) in ``scratch``'s arrays (both
    results are views of them: valid until this thread's next sort); otherwise the argsort."""
    n = int(keys.shape[0])
    bits = max(1, (n - 1).bit_length())
    if int(bound) > 1 << (62 - bits):
        order = np.argsort(keys, kind="stable")
        return order, keys[order]
    packed, order = scratch.arrays(n)[:2] if scratch is not None else (np.empty(n, np.int64), np.empty(n, np.int64))
    np.left_shift(keys, bits, out=packed, dtype=np.int64)  # int32 keys too, shifted as int64
    for c in range(0, n, PLAN_RECORDS):  # the positions, a bounded piece at a time
        d = min(n, c + PLAN_RECORDS)
        packed[c:d] |= np.arange(c, d, dtype=np.int64)
    packed.sort()
    np.bitwise_and(packed, (1 << bits) - 1, out=order)
    packed >>= bits
    return order, packed


@dataclass(frozen=True, eq=False)
class SortedRequest:
    """A request's keys sorted once: ``distinct`` ascending, ``first[j]`` the request index of
    ``distinct[j]``'s first occurrence, and what :meth:`copy_duplicates` needs (``dup`` is ``None``
    without duplicates). Views of a :class:`SortScratch`: used by the thread that sorted, before its next sort."""

    distinct: np.ndarray
    first: np.ndarray
    order: np.ndarray
    dup: np.ndarray | None

    @classmethod
    def of(cls, keys: np.ndarray, bound: int, scratch: SortScratch | None = None) -> SortedRequest:
        """Sort ``keys`` (int64 in ``[0, bound)``, at least one) and find the duplicates."""
        n = int(keys.shape[0])
        order, sorted_keys = _sorted_with_order(keys, bound, scratch)
        dup = scratch.arrays(n)[2] if scratch is not None else np.empty(n, dtype=bool)
        dup[0] = False
        np.equal(sorted_keys[1:], sorted_keys[:-1], out=dup[1:])
        if not dup.any():
            return cls(sorted_keys, order, order, None)
        return cls(sorted_keys[~dup], order[~dup], order, dup)

    @staticmethod
    def byte_rows(dest: Destination) -> ByteRows:
        """``dest``'s buffers as ``[n, record_nbytes]`` uint8 rows (what the read plans write)."""
        return ByteRows([b.reshape(b.shape[0], -1).view(np.uint8) for b in dest.buffers])

    def copy_duplicates(self, dest: Destination, rows: list[np.ndarray]) -> None:
        """Copy each duplicate from its first occurrence, once every distinct record was read (runs
        of equal keys are consecutive in the sort)."""
        if self.dup is None:
            return
        if dest.decodes:  # the first occurrences must be decoded before they are copied
            finish_decodes(dest.decodes)
            dest.decodes.clear()
        order, dup = self.order, self.dup
        src = order[np.maximum.accumulate(np.where(~dup, np.arange(order.size), 0))]
        for d, s in zip(order[dup].tolist(), src[dup].tolist()):
            rows[int(dest.which[d])][int(dest.rows[d])] = rows[int(dest.which[s])][int(dest.rows[s])]


def ascending_distinct(keys: np.ndarray) -> bool:
    """Are ``keys`` strictly ascending (sorted, no duplicates)? A look at the first few decides
    for most unsorted requests; sorted ones cost one comparison pass (no sort)."""
    n = int(keys.shape[0])
    if n < 2:
        return True
    head = min(8, n - 1)
    return bool(np.all(keys[1 : head + 1] > keys[:head])) and bool(np.all(keys[1:] > keys[:-1]))


def aligned_empty(n: int, shape: tuple[int, ...], dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous ``[n, *shape]`` array starting on a :data:`BUFFER_ALIGNMENT` boundary
    (numpy's start 16 bytes past a page), or ``offset`` bytes past one (a decoder's fastest rows,
    :meth:`~shardkit.formats.codecs.RecordCodec.row_offset`); its ``base`` owns the memory, which is what
    :class:`~shardkit.tiers.buffers.BatchPool` counts references of. A buffer of at least
    :data:`MAP_AHEAD_BYTES` has its pages mapped here (:func:`map_ahead`): it is a destination that is
    about to be written whole."""
    nbytes = int(n) * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    offset = int(offset) % BUFFER_ALIGNMENT
    raw = np.empty(nbytes + offset + BUFFER_ALIGNMENT, dtype=np.uint8)
    page = -raw.ctypes.data % BUFFER_ALIGNMENT
    if nbytes >= MAP_AHEAD_BYTES:
        map_ahead(raw.ctypes.data + page, nbytes + offset)
    start = page + offset
    return raw[start : start + nbytes].view(dtype).reshape((int(n), *shape))


#: Buffers from this size up are mapped ahead by :func:`aligned_empty` (smaller ones come from the
#: allocator's heap, whose pages are mostly mapped already).
MAP_AHEAD_BYTES = 1 << 20
_MADV_NOHUGEPAGE = 15


def map_ahead(address: int, nbytes: int) -> bool:
    """Map the pages of fresh private memory ``[address, address + nbytes)`` (``address`` page
    aligned) in one ``madvise(MADV_POPULATE_WRITE)``, in 4 KiB pages (``MADV_NOHUGEPAGE``); False where
    the kernel cannot (the pages are then mapped as they are first written, as before).

    A batch buffer's pages were mapped one fault at a time by whoever wrote them first: for JPEG
    records the decode threads, where the faults cost as much CPU as a third of the decoding on this
    VM (benchmarks/RESULTS.md, issue 36). One call maps them for a fraction of that; 4 KiB pages
    because numpy asks for huge pages, whose zeroing cost more than twice as much here, while a
    buffer written once per batch gains little from fewer TLB entries."""
    if libc_madvise is None or sys.platform != "linux":
        return False
    libc_madvise(address, nbytes, _MADV_NOHUGEPAGE)  # advice only: where refused, the pages are still mapped
    return bool(libc_madvise(address, nbytes, MADV_POPULATE_WRITE) == 0)


@dataclass(frozen=True, eq=False)
class Destination:
    """Where :meth:`PayloadArray.read_into` puts each record: record ``j`` of the request lands in row
    ``rows[j]`` of ``buffers[which[j]]``, each a C-contiguous, writeable ``[n_i, *record_shape]`` array
    of the payload dtype (the sampler's batch buffers and static cache: no copy after the read)."""

    buffers: tuple[np.ndarray, ...]
    which: np.ndarray
    rows: np.ndarray
    #: ``(offset, per)`` when record ``j`` goes to position ``offset + j`` of the buffers taken as
    #: consecutive runs of ``per`` rows (``which[j], rows[j] == divmod(offset + j, per)``; a block's
    #: batches): the read computes a piece's rows from the positions instead of gathering them from
    #: the block-sized ``which`` and ``rows`` (two cache-missing gathers per record).
    consecutive: tuple[int, int] | None = None
    #: A list to receive the decode jobs of a read (records of a codec decoded on the decode threads):
    #: the read then returns once its bytes are read, not decoded, and the caller waits for the jobs
    #: (:func:`finish_decodes`) before it uses the rows, so the next read overlaps this one's decoding.
    #: ``None``: the read returns once every record is decoded.
    decodes: list[DecodeJob] | None = None

    @classmethod
    def rows_of(cls, out: np.ndarray, n: int) -> Destination:
        """Record ``j`` into ``out[j]``, for ``j < n``."""
        # ``which`` is one zero seen n times (no n-sized array: a staged block is millions of rows).
        return cls((out,), np.broadcast_to(np.zeros(1, dtype=np.int64), (n,)),
                   np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64),
                   (0, max(1, int(n))))

    def rows_at(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(which[j], rows[j])`` for request indices ``j``."""
        if self.consecutive is None:
            return self.which[j], self.rows[j]
        offset, per = self.consecutive
        if len(self.buffers) == 1:  # one buffer (a staging block): every row is in it, no division
            return self.which[: j.size], j + offset
        which, rows = np.divmod(j + offset, per)
        return which, rows

    def check(self, n: int, shape: tuple[int, ...], dtype: np.dtype[Any], where: str) -> None:
        """Refuse destinations that do not fit ``n`` records of ``shape`` / ``dtype``."""
        if self.which.shape != (n,) or self.rows.shape != (n,):
            raise ConfigError(f"{where}: destination maps {self.which.shape}/{self.rows.shape} records, expected ({n},)")
        for b in self.buffers:
            if b.shape[1:] != tuple(shape) or b.dtype != dtype or not b.flags.c_contiguous or not b.flags.writeable:
                raise ConfigError(
                    f"{where}: destination buffers must be writeable C-contiguous [n, {', '.join(map(str, shape))}] "
                    f"{dtype}, found {b.shape} {b.dtype}"
                )
        if n and (
            int(self.which.min()) < 0 or int(self.which.max()) >= len(self.buffers) or int(self.rows.min()) < 0
            or not self._rows_fit()
        ):
            raise ConfigError(f"{where}: destination rows outside their buffers")
        if n and self.consecutive is not None:
            offset, per = self.consecutive
            ends = np.array([0, n - 1], dtype=np.int64)
            which, rows = np.divmod(ends + offset, per)  # what rows_at computes (it may skip the division)
            if (offset < 0 or per < 1 or any(b.shape[0] < per for b in self.buffers[:-1])
                    or not np.array_equal(which, self.which[ends]) or not np.array_equal(rows, self.rows[ends])):
                raise ConfigError(f"{where}: destination rows are not the consecutive runs of {per} rows from {offset} it declares")

    def _rows_fit(self) -> bool:
        """Every row inside its buffer: one comparison when all rows fit the smallest buffer (a
        block's batches), else a gather of each record's buffer length (no block-sized temporaries
        in the common case)."""
        lengths = np.array([b.shape[0] for b in self.buffers], dtype=np.int64)
        if int(self.rows.max()) < int(lengths.min()):
            return True
        return not bool(np.any(self.rows >= lengths[self.which]))


def preadv_exact(fd: int, buffers: list[memoryview], offset: int, what: str, stats: ReadStats | None = None) -> None:
    """Fill ``buffers`` with the bytes of ``fd`` from ``offset`` on (``IOV_MAX`` buffers per call, a
    short read continued where it stopped); a file that ends first is
    :class:`~shardkit.errors.TruncatedShardError` naming ``what``. Each call is counted in ``stats``."""
    for k in range(0, len(buffers), _IOV_MAX):
        chunk = buffers[k : k + _IOV_MAX]
        want = sum(b.nbytes for b in chunk)
        got = os.preadv(fd, chunk, offset)
        while got < want:
            skip, rest = got, []
            for b in chunk:
                if skip >= b.nbytes:
                    skip -= b.nbytes
                    continue
                rest.append(b[skip:])
                skip = 0
            more = os.preadv(fd, rest, offset + got)
            if more <= 0:
                raise TruncatedShardError(f"{what}: expected {want} bytes at {offset}, the file ended after {got}")
            got += more
        if stats is not None:
            stats.add(what, offset, want)
        offset += want


class PayloadArray:
    """Random and sequential access to the records of a sharded payload array with the shardkit layout,
    whether shardkit or zarr-python wrote it.

    ``path`` is the array directory; ``shards`` the dataset metadata's shard list (without it, a bare
    zarr array's shards come from the chunk grid, sizes unchecked); ``stats`` the counters to update;
    ``gap_bytes`` the coalescing threshold; ``document_digest`` the recorded size and crc32c of
    ``zarr.json``, checked before it is parsed. ``read`` is thread-safe (descriptors open under a lock,
    indexes are immutable, the shared scratch buffer only receives gap bytes).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shards: list[ShardInfo] | None = None,
        stats: ReadStats | None = None,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        document_digest: FileDigest | None = None,
    ) -> None:
        local = Path(path)
        self.path: Path | str = local
        doc_path = local / ZARR_JSON
        if not doc_path.exists():
            raise NotADatasetError(f"{local}: no payload array ({doc_path} is missing)")
        if document_digest is None:
            doc = read_json(doc_path, None)
        else:  # a dataset's array: as the version this reader opened recorded it
            doc = read_document(LocalStore(local.parent), f"{local.name}/{ZARR_JSON}", document_digest)
        shards = self._init_layout(doc, str(doc_path), local.name, shards)
        self._rel_base = local.parent if self._from_metadata else local
        self._init_state(shards, stats, gap_bytes)

    def _init_state(self, shards: list[ShardInfo], stats: ReadStats | None, gap_bytes: int) -> None:
        self.shards = shards
        self.stats = stats if stats is not None else ReadStats()
        self.gap_bytes = int(gap_bytes)
        self._fds: dict[int, int] = {}
        self._opened: dict[int, Path] = {}
        self._indexes: dict[int, ShardIndex] = {}
        #: Shards whose checked index is the fixed-size layout, not kept (see :meth:`_dense_shard`).
        self._dense_shards: set[int] = set()
        self._dense_index: tuple[int, bytes] | None = None
        #: Shards whose index is being compared with the fixed-size layout's page by page.
        self._dense_checks: dict[int, DenseIndexCheck] = {}
        self._check_lock = threading.Lock()
        self._shard_names: dict[int, str] = {}
        self._lock = threading.Lock()
        # A DataLoader worker forks from a process whose reader threads may hold either.
        renew_locks_after_fork(self, "_lock", "_check_lock")
        self._scratch = np.empty(max(self.gap_bytes, 1), dtype=np.uint8)
        self._sort_scratch = SortScratch()
        #: Shard files mapped for compressed reads (see :meth:`_mapped_runs`); ``None``: a shard that
        #: cannot be, read with ``preadv``.
        self._maps: dict[int, MappedFile | None] = {}
        self.decode_workers = 0
        self._decoders: DecodeThreads | None = None
        #: False: compressed records are not decoded, their stored bytes start their rows (zeros after).
        self.decode = True
        #: Set by :meth:`stop_with`: a long read checks it between pieces (see :meth:`_check_stop`).
        self._stop: threading.Event | None = None

    def stop_with(self, event: threading.Event) -> None:
        """Let a read give up once ``event`` is set: a block of small records at 10^8 spans gigabytes,
        so the read checks it between plan pieces and bounce chunks and raises
        :class:`~shardkit.stopping.Stopped` instead of reading the rest (a closing sampler
        returns within a chunk, not a block)."""
        self._stop = event

    def _check_stop(self) -> None:
        """Raise :class:`~shardkit.stopping.Stopped` when the event of :meth:`stop_with` is set."""
        if self._stop is not None and self._stop.is_set():
            raise Stopped()

    def use_decoders(self, workers: int) -> None:
        """Decode compressed records on ``workers`` threads (0: in the reading thread), so the reading
        thread goes on to the next run while the records it read are decoded into their rows (the
        codecs release the GIL). Only compressed arrays start threads."""
        self.decode_workers = max(0, int(workers))

    def _init_layout(
        self, doc: dict[str, Any], where: str, array_name: str, shards: list[ShardInfo] | None
    ) -> list[ShardInfo]:
        """Parse the array document and check ``shards`` against it (shared by every reader of the
        layout, local or remote); returns the shard list (derived from the chunk grid without one)."""
        self.layout = ShardedLayout.parse(doc, where)
        self.shape, self.dtype = self.layout.shape, self.layout.dtype
        self.records_per_shard, self.codec = self.layout.records_per_shard, self.layout.codec
        self.fill_value = self.layout.fill_value
        self.record = FieldSpec(self.shape[1:], self.dtype.name)
        self.record_nbytes = self.record.nbytes
        self.num_records = self.shape[0]
        n_shards = math.ceil(self.num_records / self.records_per_shard) if self.num_records else 0
        ndim = len(self.shape)
        self._from_metadata = shards is not None
        s = self.records_per_shard
        if shards is None:
            return [ShardInfo(chunk_key(array_name, i, ndim, self.layout.separator).split("/", 1)[1], i * s,
                              min((i + 1) * s, self.num_records), -1, -1) for i in range(n_shards)]  # fmt: skip
        if len(shards) != n_shards:
            raise NotADatasetError(
                f"{self.path}: metadata lists {len(shards)} shards, expected {n_shards} for "
                f"{self.num_records} records of {self.records_per_shard} per shard"
            )
        for i, info in enumerate(shards):
            expected = chunk_key(array_name, i, ndim, self.layout.separator)
            if info.path != expected:
                raise (UnsafePathError if ".." in info.path or info.path.startswith("/") else NotADatasetError)(
                    f"{self.path}: shard {i} path {info.path!r} in the metadata is not the array's chunk key "
                    f"{expected!r}"
                )
        return shards

    # ------------------------------------------------------------------ files and indexes
    def shard_path(self, i: int) -> Path:
        """The local file of shard ``i`` (once opened: the one read, which is the retired copy of the
        version this reader opened when a later version replaced the shard; see
        :mod:`~shardkit.formats.versions`)."""
        return self._opened.get(i) or self._rel_base / self.shards[i].path

    def shard_location(self, i: int) -> str:
        """Shard ``i`` as a path or URL, for messages."""
        return str(self.shard_path(i))

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            with self._lock:
                fd = self._fds.get(i)
                if fd is None:
                    path = self.shard_path(i)
                    real = resolve_inside(self._rel_base, self.shards[i].path, "payload shard")
                    try:
                        fd = open_regular(real, "payload shard")
                    except FileNotFoundError:
                        info = self.shards[i]
                        raise MissingShardError(f"{path}: shard {i} (records {info.start}-{info.stop - 1}) is missing") from None
                    fd = self._of_this_version(i, fd, real)
                    # Every pass over a shard reads ascending offsets: ask for aggressive readahead.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self._fds[i] = fd
        return fd

    def _shard_str(self, i: int) -> str:
        """:meth:`shard_location`, cached (the read path names the file of every request)."""
        name = self._shard_names.get(i)
        if name is None:
            name = self._shard_names[i] = self.shard_location(i)
        return name

    def _of_this_version(self, i: int, fd: int, real: Path) -> int:
        """``fd``, or the retired copy of shard ``i`` when a later version replaced the file (it has
        grown: a commit only ever adds records to a shard). Checked on the open descriptor, so a
        replacement between the check and the open is caught."""
        info = self.shards[i]
        if info.nbytes < 0 or os.fstat(fd).st_size == info.nbytes:
            return fd
        store = LocalStore(self._rel_base)
        try:
            older = older_copy(store, info.path, info.nbytes, info.crc32c,
                               TruncatedShardError(f"{real}: shard {i} is not the {info.nbytes} bytes recorded"))
        except TruncatedShardError:
            return fd  # damaged, not replaced: index() reports it
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        self._opened[i] = store.local_path(older)
        return open_regular(self._opened[i], "payload shard")

    def index(self, i: int) -> ShardIndex:
        """The checked index of shard ``i`` (read once, then cached)."""
        idx = self._indexes.get(i)
        if idx is not None:
            return idx
        raw, size = self._index_bytes(i, index_nbytes(self.records_per_shard))
        idx = self._decode_index(i, raw, size)
        self._indexes[i] = idx
        return idx

    def stored_index(self, i: int) -> ShardIndex:
        """The index as stored in shard ``i``'s file, checked (what ``verify`` inspects)."""
        return self.index(i)

    def _decode_index(self, i: int, raw: bytes, size: int) -> ShardIndex:
        """Check the index bytes ``raw`` of shard ``i`` (``size`` bytes in all) against the metadata."""
        info = self.shards[i]
        path = self.shard_location(i)
        isize = index_nbytes(self.records_per_shard)
        if info.nbytes >= 0 and size != info.nbytes:
            raise TruncatedShardError(
                f"{path}: shard {i} (records {info.start}-{info.stop - 1}) should be {info.nbytes} bytes, "
                f"found {size}"
            )
        cut = max(0, len(raw) - isize)  # what precedes the index: the records' tail, when checked
        sample, raw = raw[:cut], raw[cut:]
        idx = ShardIndex.decode(raw, self.records_per_shard, path=path, data_nbytes=size - isize, recorded_crc32c=info.index_crc32c)
        count = info.count
        if info.nbytes >= 0 and not idx.present[:count].all():
            # A dataset's shard holds every one of its records: an empty slot would read as the fill
            # value (zarr), which the sampler and verify must both refuse, here, in the one check.
            j = int(np.argmin(idx.present[:count]))
            raise CorruptIndexError(
                f"{path}: index slot {j} (record {info.start + j}) is empty, but the dataset metadata says the "
                f"shard holds records {info.start}-{info.stop - 1}"
            )
        if self.codec is None:
            if info.nbytes >= 0:  # a dataset's shard: exactly the fixed-size layout
                idx.check_dense(path, count, self.record_nbytes)
            elif np.any(idx.nbytes[:count][idx.present[:count]] != self.record_nbytes):
                raise CorruptIndexError(f"{path}: uncompressed records must be {self.record_nbytes} bytes, index says otherwise")
        if self._tail_nbytes(i):
            self._check_tail(i, sample)
        return idx

    def _tail_nbytes(self, i: int) -> int:
        """Bytes before shard ``i``'s index that are read with it to check its ``tail_crc32c`` (0 when
        the metadata records none: an older dataset, or a bare array)."""
        info = self.shards[i]
        if info.tail_crc32c is None or info.nbytes < 0:
            return 0
        return ShardInfo.tail_nbytes(info.nbytes - index_nbytes(self.records_per_shard))

    def _check_tail(self, i: int, sample: bytes) -> None:
        """Refuse shard ``i`` when the end of its records (read with the index) is not what the metadata
        records: a shard copied or swapped, or its last record changed. Changes elsewhere in the records
        are only seen by ``verify``."""
        info = self.shards[i]
        crc = crc32c_of(sample)
        if crc != info.tail_crc32c:
            raise ChecksumError(
                f"{self.shard_location(i)}: shard {i} (records {info.start}-{info.stop - 1}): the last {len(sample)} "
                f"bytes of its records have crc32c {crc:#010x}, the metadata records {info.tail_crc32c:#010x}: this "
                "file is not the dataset's shard (a shard copied from another dataset or swapped with another "
                "one?) or its last record was changed"
            )

    def _index_bytes(self, i: int, isize: int) -> tuple[bytes, int]:
        """The last ``isize`` bytes of shard ``i`` (preceded by the :meth:`_tail_nbytes` checked with
        them) and the shard's size (a shard that is too small for its index is a TruncatedShardError)."""
        fd = self._fd(i)
        path = self.shard_location(i)
        size = os.fstat(fd).st_size
        info = self.shards[i]
        if info.nbytes >= 0 and size != info.nbytes:
            return b"", size  # index() reports the size mismatch
        if size < isize:
            raise TruncatedShardError(f"{path}: shard {i} is {size} bytes, smaller than its {isize}-byte index")
        want = isize + self._tail_nbytes(i)  # the records' tail comes with the index (one request)
        offset = size - want
        raw = os.pread(fd, want, offset)
        self.stats.add(path, offset, want)
        return raw, size

    def _dense_shard(self, i: int, local: np.ndarray | None) -> bool:
        """True when shard ``i`` is a local dataset shard of the fixed-size layout, whose records
        ``local`` (shard-local, ascending; ``None``: all of them) may be read at ``j * record_nbytes``: its size, crc32c and
        tail were checked at its first read, and the index entries of ``local`` are the layout's
        (compared a page at a time, each page once: :mod:`shardkit.formats.dense_index`). Its index
        (16 bytes a record, the sampler's largest per-record cost) is not kept. Anything else is
        decoded and checked by :meth:`index` (CorruptIndexError unless the dense layout, all present)."""
        if i in self._dense_shards:
            return True
        if type(self) is not PayloadArray or self.codec is not None or self.shards[i].nbytes < 0:
            return False
        with self._check_lock:  # one check at a time: a shard's pages are marked once
            if i in self._dense_shards:
                return True
            check = self._dense_checks.get(i)
            if check is None and i not in self._indexes:
                check = self._dense_check(i)
                if check is not None:
                    self._dense_checks[i] = check
            if check is not None and check.check(local) and not check.done:
                return True
            if check is None or not check.done:
                self.index(i)  # reads and checks the whole index (CorruptIndexError unless dense)
            with self._lock:
                self._dense_shards.add(i)
                self._indexes.pop(i, None)
                self._dense_checks.pop(i, None)
                if len(self._dense_shards) == len(self.shards):
                    self._dense_index = None
        return True

    def record_offsets(self, i: int, local: np.ndarray) -> np.ndarray:
        """Byte offsets (int64) in shard ``i``'s file of its records ``local`` (shard-local,
        ascending): ``j * record_nbytes`` for the checked fixed-size layout (only the index pages
        these records need are checked, :meth:`_dense_shard`), else the entries of its index (read
        and checked whole). For readers of the shard files of their own (tiers/ssd_direct.py)."""
        if self._dense_shard(i, local):
            return local.astype(np.int64) * self.record_nbytes
        return np.asarray(self.index(i).offsets[local], dtype=np.int64)

    def _dense_check(self, i: int) -> DenseIndexCheck | None:
        """The page-wise check of shard ``i``'s index, once its size, stored and recorded crc32c and
        tail are the fixed-size layout's (the tail is read and checked here); ``None`` for anything
        else, which :meth:`index` then checks and reports."""
        info = self.shards[i]
        isize = index_nbytes(self.records_per_shard)
        fd = self._fd(i)
        size = os.fstat(fd).st_size
        if size != info.nbytes or size - isize < info.count * self.record_nbytes:
            return None
        crc = dense_index_crc32c(info.count, self.records_per_shard, self.record_nbytes)
        if info.index_crc32c is not None and info.index_crc32c != crc:
            return None
        cut = self._tail_nbytes(i)
        path = self._shard_str(i)
        def read_index(buf: memoryview, offset: int) -> None:
            self._check_stop()  # a closing run stops between index requests too, as between chunks
            self._preadv_all(fd, path, [buf], offset)

        check = DenseIndexCheck(self.records_per_shard, info.count, self.record_nbytes, size - isize, read_index)
        small = self.records_per_shard <= WHOLE_INDEX_ENTRIES
        body = isize - CHECKSUM_NBYTES if small else 0
        raw = np.empty(cut + body + CHECKSUM_NBYTES, dtype=np.uint8)  # the tail, (a small index,) its crc32c
        if small:  # one request, as the whole index is read
            self._preadv_all(fd, path, [raw.data], size - raw.size)
        else:  # two small reads: the index pages come with the records that need them
            if cut:
                self._preadv_all(fd, path, [raw.data[:cut]], size - isize - cut)
            self._preadv_all(fd, path, [raw.data[cut:]], size - CHECKSUM_NBYTES)
        if int.from_bytes(raw[cut + body :].tobytes(), "little") != crc:
            return None
        if small and not check.compare_whole(raw[cut : cut + body].view("<u8")):
            return None
        if cut:
            self._check_tail(i, raw[:cut].tobytes())
        return check

    def _dense_index_bytes(self, count: int) -> bytes:
        """The encoded index of a fixed-size shard of ``count`` records (the last one built is kept
        until every shard was checked: all but the last shard have the same)."""
        kept = self._dense_index
        if kept is None or kept[0] != count:
            kept = self._dense_index = (count, ShardIndex.dense(count, self.records_per_shard, self.record_nbytes).encode())
        return kept[1]

    def is_dense(self, i: int) -> bool:
        """True when shard ``i`` is the fixed-size layout (record j at ``j * record_nbytes``). A local
        dataset shard's index pages not compared yet are compared a bounded piece at a time (as by
        :meth:`_dense_shard`): the whole index is never held, nor kept."""
        if self.codec is not None:
            return False
        if self._dense_shard(i, None):
            return True
        idx = self.index(i)
        count = self.shards[i].count
        expected = np.arange(count, dtype=np.uint64) * np.uint64(self.record_nbytes)
        return bool(np.array_equal(idx.offsets[:count], expected))

    def map_shard(self, i: int) -> tuple[MappedFile, np.ndarray] | None:
        """Shard ``i``'s records as a read-only ``(count, *record shape)`` view of its file's pages,
        and the mapping behind it (its units records); ``None`` unless the shard is a local file of
        the checked fixed-size layout (record j at ``j * record_nbytes``). The mapping is private (copy
        on write): nothing done to the view reaches the file. For a reader that keeps every record in
        RAM: the page cache then holds the only copy (docs/design.md §4, *Static cache*)."""
        count = int(self.shards[i].count)
        if count == 0 or not self._dense_shard(i, None):
            return None
        f = MappedFile(self._fd(i), count * self.record_nbytes, unit=self.record_nbytes)
        view = np.frombuffer(f.map, dtype=self.dtype, count=count * int(np.prod(self.record.shape, dtype=np.int64)))
        view = view.reshape((count, *self.record.shape))
        view.flags.writeable = False
        return f, view

    # ------------------------------------------------------------------ reading
    def empty(self, n: int) -> np.ndarray:
        """A destination buffer for ``n`` records, page aligned (see :func:`aligned_empty`)."""
        return aligned_empty(n, self.record.shape, self.dtype)

    def read(self, keys: np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Read records ``keys`` (any order, duplicates allowed) into ``out[j] = record keys[j]``."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        n = keys.shape[0]
        if out is None:
            out = self.empty(n)
        elif out.shape[0] < n or out.shape[1:] != self.record.shape or out.dtype != self.dtype:
            raise ConfigError(
                f"{self.path}: destination must be at least {(n, *self.record.shape)} {self.dtype}, "
                f"found {out.shape} {out.dtype}"
            )
        self.read_into(keys, Destination.rows_of(out, n))
        return out

    def read_into(self, keys: np.ndarray | list[int], dest: Destination) -> None:
        """Read records ``keys`` (any order, duplicates allowed: read once, then copied) straight into
        their :class:`Destination` rows, each shard visited once with ascending offsets (docs/design.md §3)."""
        keys = self.checked_keys(keys, dest)
        n = keys.shape[0]
        if n == 0:
            return
        if ascending_distinct(keys):  # a staged block's keys (tiers/pipeline.py): nothing to sort
            self.read_distinct(keys, None, dest, SortedRequest.byte_rows(dest))
        else:
            req = SortedRequest.of(keys, self.num_records, self._sort_scratch)
            rows = req.byte_rows(dest)
            self.read_distinct(req.distinct, req.first, dest, rows)
            req.copy_duplicates(dest, rows)
        self.stats.add_records(n)

    def checked_keys(self, keys: np.ndarray | list[int], dest: Destination) -> np.ndarray:
        """``keys`` as a flat int64 array, checked against ``dest`` (count, record shape, dtype) and
        this array's records (:class:`IndexError` naming the first key outside them)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        dest.check(keys.shape[0], self.record.shape, self.dtype, str(self.path))
        if keys.size and (int(keys.min()) < 0 or int(keys.max()) >= self.num_records):
            bad = int(keys[(keys < 0) | (keys >= self.num_records)][0])
            raise IndexError(f"{self.path}: record key {bad} outside [0, {self.num_records})")
        return keys

    def read_distinct(self, distinct: np.ndarray, first: np.ndarray | None, dest: Destination,
                      rows: list[np.ndarray]) -> None:
        """The reading half of :meth:`read_into`: records ``distinct`` (ascending, distinct, checked)
        into rows ``dest.rows[first]`` of ``rows[dest.which[first]]`` (``first`` ``None``: request
        index ``j`` for ``distinct[j]``; ``rows``: the destination buffers as uint8 rows), without
        counting records (the caller does, once per request).
        A mixture sorts a block once and calls this per dataset (readers/sources.py)."""
        staged = first is None and self._into_consecutive_rows(dest, rows)
        # Planned and read in pieces of ascending keys, so the plan's per-record arrays stay bounded:
        # still one pass of ascending offsets per shard (a run cut at a piece's end is two requests).
        c = 0
        while c < distinct.size:
            self._check_stop()
            if staged:
                assert isinstance(rows, ByteRows)
                d = self._read_grid_piece(distinct, c, rows)
                if d > c:
                    c = d
                    continue
            f = first[c : c + PLAN_RECORDS] if first is not None else np.arange(c, min(c + PLAN_RECORDS, distinct.size))
            plan = self._plan(distinct[c : c + PLAN_RECORDS], *dest.rows_at(f), rows)
            if plan.size:
                self._read_plan(plan, rows, dest.decodes)
            c += PLAN_RECORDS

    def _into_consecutive_rows(self, dest: Destination, rows: list[np.ndarray]) -> bool:
        """Does request index ``j`` go to row ``j`` of one buffer (a staged block, docs/design.md §4),
        for small uncompressed records of this reader's own shards? Their pieces are then read by
        :meth:`_read_grid_piece`, without a plan."""
        return (dest.consecutive is not None and dest.consecutive[0] == 0 and len(dest.buffers) == 1
                and isinstance(rows, ByteRows) and self.codec is None and self.record_nbytes < SCATTER_MIN_BYTES
                and type(self) is PayloadArray)  # fmt: skip

    def _read_grid_piece(self, distinct: np.ndarray, c: int, rows: ByteRows) -> int:
        """Read request indices ``[c, c + PLAN_RECORDS)`` of ``distinct`` (ascending keys, request
        index ``j`` into row ``j`` of ``rows``' one buffer) and return where the piece ends; ``c``
        when it needs a plan.

        A piece of the checked fixed-size layout whose gaps are all read (none over ``gap_bytes``)
        and whose records fill enough of each shard's part to go through the bounce buffer:
        :meth:`_read_plan` would make each part one run and read it in the same bounce pieces (the
        same requests). Here each bounce piece is one ``preadv`` and one ``np.take`` by the keys'
        distances from the piece's first key, without the plan's per-record arrays (shard, offset,
        size, buffer, row, gap: most of a staged block's reading CPU besides the copies)."""
        rec, rps = self.record_nbytes, self.records_per_shard
        d = min(distinct.size, c + PLAN_RECORDS)
        first, last = int(distinct[c]) // rps, int(distinct[d - 1]) // rps
        cuts = [c, *(c + np.searchsorted(distinct[c:d], np.arange(first + 1, last + 1) * rps)).tolist(), d]
        parts = []
        for i, (a, b) in zip(range(first, last + 1), itertools.pairwise(cuts)):
            if a == b:
                continue
            local = distinct[a:b] - i * rps
            span = (int(local[-1]) - int(local[0]) + 1) * rec
            if b - a > 1 and (int(np.diff(local).max()) - 1) * rec > self.gap_bytes:
                return c  # runs to skip between: the plan's
            if 2 * (b - a) * rec < span and span > (b - a) * IOVEC_BYTES:
                return c  # too sparse for the bounce buffer: the plan's (one iovec a record)
            if not self._dense_shard(i, local):
                return c
            parts.append((i, a, local, span))
        cached = [self._cached_map(i, local) for i, _, local, _ in parts]
        cold = [part for part, f in zip(parts, cached) if f is None]
        if len(parts) > 1 and cold:  # several runs: announced first, as _read_plan does
            self._announce_ranges((self._fd(i), int(local[0]) * rec, span) for i, _, local, span in cold)
        out = rows.records(0)
        bounce = None
        for (i, at, local, _), f in zip(parts, cached):
            if f is not None:
                self._gather_mapped(i, f, local, out[at : at + local.size])
                continue
            bounce = self._bounce_buffer(1) if bounce is None else bounce
            for a, b, piece, take in self._bounce_pieces(self._fd(i), self._shard_str(i), local, rec, bounce):
                dst = out[at + a : at + b]
                if take is None:
                    dst[...] = _records(piece)
                else:
                    np.take(_records(piece), take, axis=0, out=dst, mode="clip")
        return d

    def _cached_map(self, i: int, local: np.ndarray) -> MappedFile | None:
        """Shard ``i``'s mapping when the pages from record ``local[0]`` to ``local[-1]`` (ascending,
        shard-local) are in the page cache (:data:`CACHED_SAMPLE` of them asked), else ``None``
        (those records are read: one sequential pass). A page the kernel dropped all the same is
        read when the gather touches it."""
        f = self._map_file(i)
        rec = self.record_nbytes
        if f is None or not f.cached(int(local[0]) * rec, (int(local[-1]) + 1) * rec, sample=CACHED_SAMPLE):
            return None
        return f

    def _gather_mapped(self, i: int, f: MappedFile, local: np.ndarray, dst: np.ndarray) -> None:
        """Records ``local`` (ascending, shard-local) of shard ``i`` (the fixed-size layout, its pages in
        the page cache) into ``dst`` (opaque records, :func:`_records`), one ``np.take`` from its mapping per window of
        :data:`BOUNCE_BYTES`, each window's pages unmapped after it (:meth:`MappedFile.drop`).

        A sparse block of small records wants a few records of every page: the bounce read copied
        every byte of the span to take a few of them, where mapping a cached page only maps it.
        Unmapping each window keeps the mapped pages (which count in the RSS) at one window, as the
        bounce buffer was. Counted as the bounce read would be: each window one request of its span."""
        rec, path = self.record_nbytes, self._shard_str(i)
        view = _records(np.frombuffer(f.map, dtype=np.uint8, count=int(self.shards[i].count) * rec).reshape(-1, rec))
        per = max(1, BOUNCE_BYTES // rec)
        a, n = 0, int(local.size)
        while a < n:
            self._check_stop()
            first = int(local[a])
            b = a + int(np.searchsorted(local[a:], first + per))
            end = (int(local[b - 1]) + 1) * rec
            np.take(view, local[a:b], axis=0, out=dst[a:b], mode="clip")
            f.drop(first * rec, end)
            self.stats.add(path, first * rec, end - first * rec)
            a = b

    def _read_plan(self, plan: _Plan, rows: list[np.ndarray], decodes: list[DecodeJob] | None = None) -> None:
        """Read every record of ``plan`` into its row (the I/O half of :meth:`read_into`); decode jobs
        go to ``decodes`` when given (see :attr:`Destination.decodes`)."""
        if plan.num_runs > 1 and self.codec is None:
            # A sparse selection: announce every run first, so the kernel queues all of them at
            # once (asynchronous readahead at a deep device queue) instead of one at a time.
            self._announce(plan)
        if self.codec is not None:
            self._read_compressed(plan, rows, decodes)
        else:
            bounced = plan.dense_runs() if self.record_nbytes < SCATTER_MIN_BYTES else np.zeros(plan.num_runs, bool)
            self._read_scattered(plan, rows, np.flatnonzero(~bounced))
            self._read_bounced(plan, rows, np.flatnonzero(bounced))

    def _file(self, plan: _Plan, i: int) -> tuple[int, str]:
        """The open file and name of shard ``i`` of ``plan``."""
        return plan.files(i) if plan.files is not None else (self._fd(i), self._shard_str(i))

    def _announce(self, plan: _Plan, skip: Container[int] = ()) -> None:
        """``POSIX_FADV_WILLNEED`` for every run of ``plan`` (but those of shards ``skip``): the kernel
        starts reading all of them."""
        start, end = plan.spans()
        self._announce_ranges((self._file(plan, shard)[0], a, b - a)
                              for shard, a, b in zip(plan.shard[plan.run_starts].tolist(), start.tolist(), end.tolist())
                              if shard not in skip)  # fmt: skip

    @staticmethod
    def _announce_ranges(ranges: Iterable[tuple[int, int, int]]) -> None:
        """``POSIX_FADV_WILLNEED`` for every ``(fd, start, length)`` of ``ranges``: the kernel queues
        all of them at once (asynchronous readahead at a deep device queue), not one at a time."""
        for fd, start, length in ranges:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)

    def _plan(self, keys: np.ndarray, which: np.ndarray, row: np.ndarray, rows: list[np.ndarray]) -> _Plan:
        """Every distinct wanted record (``keys`` ascending) in read order, cut into coalesced runs."""
        shard_of = keys // self.records_per_shard
        bounds = (np.flatnonzero(np.diff(shard_of)) + 1).tolist()
        parts: list[tuple[np.ndarray, ...]] = []
        grid = True
        for a, b in zip([0, *bounds], [*bounds, keys.size]):
            i = int(shard_of[a])
            local = keys[a:b] - i * self.records_per_shard
            w, r = which[a:b], row[a:b]
            if self._dense_shard(i, local):  # the fixed-size layout, checked: record j at j * record_nbytes
                offs = local * self.record_nbytes
                parts.append((np.full(offs.size, i, dtype=np.int64), offs,
                              np.full(offs.size, self.record_nbytes, dtype=np.int64), w, r))  # fmt: skip
                continue
            grid = False
            idx = self.index(i)
            offs = idx.offsets[local].astype(np.int64)
            sizes = idx.nbytes[local].astype(np.int64)
            present = idx.present[local]
            if not present.all():
                # zarr: a chunk never written reads as the fill value.
                for wi, ri in zip(w[~present].tolist(), r[~present].tolist()):
                    rows[wi][ri].view(self.dtype)[...] = self.fill_value
                offs, sizes, w, r = offs[present], sizes[present], w[present], r[present]
            by_off = np.argsort(offs, kind="stable")
            offs, sizes = offs[by_off], sizes[by_off]
            if np.any(offs[1:] < offs[:-1] + sizes[:-1]):
                raise CorruptIndexError(f"{self.shard_location(i)}: index entries of shard {i} overlap")
            parts.append((np.full(offs.size, i, dtype=np.int64), offs, sizes, w[by_off], r[by_off]))
        # One shard (most pieces of a block of sorted keys): its arrays as they are, not copied.
        shard, offs, sizes, w, r = parts[0] if len(parts) == 1 else (np.concatenate(p) for p in zip(*parts))
        new_shard = np.ones(shard.size, dtype=bool)
        new_shard[1:] = shard[1:] != shard[:-1]
        gap = np.zeros(shard.size, dtype=np.int64)
        gap[1:] = offs[1:] - (offs[:-1] + sizes[:-1])
        run_starts = np.flatnonzero(new_shard | (gap > self.gap_bytes))
        return _Plan(shard, offs, sizes, w, r, new_shard, gap, run_starts, grid=grid)

    def _read_scattered(self, plan: _Plan, rows: list[np.ndarray], runs: np.ndarray) -> None:
        """Runs ``runs`` of ``plan``, each one ``preadv`` that scatters every record into its row
        and gaps into the scratch buffer; records adjacent both in the file and in one destination
        buffer share one ``iovec`` (a dense read into consecutive rows is one large request)."""
        if runs.size == 0:
            return
        rec = self.record_nbytes
        addr = np.array([r.ctypes.data for r in rows], dtype=np.int64)[plan.which] + plan.row.astype(np.int64) * rec
        head = np.ones(plan.size, dtype=bool)
        head[1:] = (plan.gap[1:] != 0) | (addr[1:] != addr[:-1] + rec) | (plan.which[1:] != plan.which[:-1])
        head[plan.run_starts] = True
        heads = np.flatnonzero(head)
        run_of_head = np.searchsorted(plan.run_starts, heads, side="right") - 1
        counts = np.diff(np.append(heads, plan.size))
        keep = np.isin(run_of_head, runs)
        heads, run_of_head, counts = heads[keep], run_of_head[keep], counts[keep]
        scratch = self._scratch.data
        offs_l, which_l, row_l, count_l, run_l = (plan.offs[heads].tolist(), plan.which[heads].tolist(),
                                                  plan.row[heads].tolist(), counts.tolist(), run_of_head.tolist())  # fmt: skip
        h = 0
        for run in runs.tolist():
            buffers: list[memoryview] = []
            start = cursor = offs_l[h]
            while h < len(offs_l) and run_l[h] == run:
                off, w, r, count = offs_l[h], which_l[h], row_l[h], count_l[h]
                if off > cursor:
                    buffers.append(scratch[: off - cursor])
                buffers.append(rows[w][r : r + count].data.cast("B"))
                cursor = off + count * rec
                h += 1
            self._preadv_all(*self._file(plan, int(plan.shard[plan.run_starts[run]])), buffers, start)

    def _read_bounced(self, plan: _Plan, rows: list[np.ndarray], runs: np.ndarray) -> None:
        """Runs ``runs`` of small records: read whole in pieces of at most :data:`BOUNCE_BYTES`, scattered by numpy copies."""
        if runs.size == 0:
            return
        # Larger pieces when the records go to many buffers (a block's batches), so each buffer's
        # share of a piece is hundreds of records, not a few (a numpy call per buffer and piece).
        bounce = self._bounce_buffer(len(rows))
        bounds = plan.runs()
        for run in runs.tolist():
            a0, b0 = bounds[run]
            fd, path = self._file(plan, int(plan.shard[a0]))
            pieces = self._bounce_pieces(fd, path, plan.offs[a0:b0], 1, bounce, grid=plan.grid)
            for a, b, piece, take in pieces:
                _scatter_rows(rows, plan.which[a0 + a : a0 + b], plan.row[a0 + a : a0 + b], piece, take)

    def _bounce_buffer(self, buffers: int) -> np.ndarray:
        """The bounce buffer of one read into ``buffers`` destination buffers: at least
        :data:`BOUNCE_BYTES`, and 512 records per buffer up to twice that."""
        rec = self.record_nbytes
        return np.empty(max(rec, min(2 * BOUNCE_BYTES, max(BOUNCE_BYTES, 512 * rec * buffers))), dtype=np.uint8)

    def _bounce_pieces(self, fd: int, path: str, starts: np.ndarray, unit: int, bounce: np.ndarray,
                       grid: bool = True) -> Iterator[tuple[int, int, np.ndarray, np.ndarray | None]]:  # fmt: skip
        """Read one run of small records of file ``fd`` through ``bounce``, one ``preadv`` a piece: record
        ``j`` starts at byte ``starts[j] * unit`` (ascending; ``unit`` 1: byte offsets, ``unit``
        ``record_nbytes``: record indices). Yields ``(a, b, piece, take)`` for records ``[a, b)``:
        ``piece`` the bytes read as ``[k, record_nbytes]`` rows and ``take`` the row of each record
        (``None``: row ``j`` is record ``a + j``); the caller copies them out before the next piece.
        ``grid``: every offset is a whole number of records (else a record off the grid is cut out
        of the piece on its own)."""
        rec = self.record_nbytes
        reach = (bounce.size - rec) // unit  # from a piece's first start to its last
        a, n = 0, int(starts.size)
        while a < n:
            self._check_stop()
            base = int(starts[a])
            b = a + max(1, int(np.searchsorted(starts[a:], base + reach, side="right")))
            length = (int(starts[b - 1]) - base) * unit + rec
            self._preadv_all(fd, path, [bounce.data[:length]], base * unit)
            rel = starts[a:b] - base
            take = None
            if not grid and unit == 1 and np.any(rel % rec):  # records off the grid (a bare array): one row each
                piece = np.stack([bounce[o : o + rec] for o in rel.tolist()])
            elif int(rel[-1]) * unit == (b - a - 1) * rec:  # no gaps: the bounce buffer itself, as records
                piece = bounce[:length].reshape(-1, rec)
            else:  # the bounce buffer as records, each wanted one taken by its row (gaps skipped)
                piece, take = bounce[: (length // rec) * rec].reshape(-1, rec), rel if unit == rec else rel // rec
            yield a, b, piece, take
            a = b

    def _preadv_all(self, fd: int, path: str, buffers: list[memoryview], offset: int) -> None:
        preadv_exact(fd, buffers, offset, path, self.stats)

    def _read_compressed(self, plan: _Plan, rows: list[np.ndarray], decodes: list[DecodeJob] | None = None) -> None:
        """Compressed records: a mapped shard's records are handed to the decode threads
        (:class:`_DecodeJobs`) at once, straight from its pages (a sparse read has several runs a
        shard, each a loop turn of the reading thread under the GIL before); a shard read with
        ``preadv`` has each run read whole into a temporary and its records handed over while the
        next run is read. Without decode threads each is decoded here.
        Returns once every record is decoded, or with ``decodes`` given once every run is read (its
        jobs appended there for the caller to wait for); on an error, once no decoder still writes
        into ``rows``."""
        assert self.codec is not None
        jobs: list[DecodeJob] = [] if decodes is None else decodes
        batcher = _DecodeJobs(self, rows, jobs, plan.size)
        # The plan as lists once (not a few numpy slices and conversions per run).
        offs, sizes = plan.offs.tolist(), plan.sizes.tolist()
        which, row, shard = plan.which.tolist(), plan.row.tolist(), plan.shard.tolist()
        try:
            # The plan is in shard order: each shard's records are one range of it.
            firsts = np.flatnonzero(plan.new_shard).tolist()
            distinct = [shard[a] for a in firsts]
            mapped = self._mapped_runs(plan, plan.shard[plan.run_starts], distinct)
            if plan.num_runs > 1 and len(mapped) < len(distinct):
                self._announce(plan, skip=mapped)  # runs read with preadv: as for records of a fixed size (see _read_plan)
            starts = plan.run_starts.tolist()
            span_start, span_end = plan.spans()
            k = 0  # the shard's first run
            for a, b in zip(firsts, [*firsts[1:], plan.size]):
                i, k1 = shard[a], bisect.bisect_left(starts, b, k)
                if i in mapped:  # the shard's pages are mapped: its records decode from them, handed over at once
                    self.stats.add_runs(self._shard_str(i), span_start[k:k1], span_end[k:k1])
                    batcher.add(i, 0, mapped[i], offs[a:b], sizes[a:b], which[a:b], row[a:b])
                else:
                    for ra, rb in zip(starts[k:k1], [*starts[k + 1 : k1], b]):
                        start, end = offs[ra], offs[rb - 1] + sizes[rb - 1]
                        view = np.empty(end - start, dtype=np.uint8).data
                        self._preadv_all(self._fd(i), self._shard_str(i), [view], start)
                        batcher.add(i, start, view, [o - start for o in offs[ra:rb]], sizes[ra:rb], which[ra:rb], row[ra:rb])
                k = k1
            batcher.flush()
        except BaseException:
            wait_decodes(jobs)  # no decoder writes into the rows once the error is raised
            raise
        if decodes is None:
            finish_decodes(jobs)

    def _mapped_runs(self, plan: _Plan, shards: np.ndarray, distinct: list[int]) -> dict[int, memoryview]:
        """The shards of ``plan`` (its runs' ``shards``, ``distinct`` ones ascending) as views of their
        mapped files, the pages of its runs made resident (:class:`~shardkit.formats.mapping.MappedFile`:
        every run of the plan announced, then each shard's populated in one system call: the kernel
        reads what the page cache lacks, as ``preadv`` would; pages this reader made resident before
        are not asked again): the decoders then read the records from the page cache itself, and the
        reading thread neither copies them nor makes a call per run. Left out (read with ``preadv``):
        every shard of a plan over several arrays, a shard that cannot be mapped (or past
        :data:`MAX_MAPPED_FILES`), one whose pages cannot be made resident (a shard truncated under
        the reader: ``preadv`` then names the error). A page the kernel drops later is read again by
        the decoder that touches it."""
        out: dict[int, memoryview] = {}
        if plan.files is not None:
            return out
        start, end = plan.spans()
        first, last = start // mmap.PAGESIZE, (end - 1) // mmap.PAGESIZE + 1
        todo: list[tuple[int, MappedFile, np.ndarray]] = []
        for i in distinct:
            f = self._map_file(i)
            if f is None:
                continue
            sel = np.flatnonzero(shards == i)
            missing = np.concatenate([[0], np.cumsum(~f.resident)])
            todo.append((i, f, sel[missing[last[sel]] > missing[first[sel]]]))  # runs with a page not yet resident
        if sum(sel.size for _, _, sel in todo) > 1:  # the kernel queues every read at once (see _read_plan)
            for _, f, sel in todo:
                f.announce(start[sel], end[sel])
        for i, f, sel in todo:
            if sel.size:
                try:
                    f.populate(start[sel], end[sel])
                except OSError:
                    continue
                for a, b in zip(first[sel].tolist(), last[sel].tolist()):
                    f.resident[a:b] = True
            out[i] = f.bytes
        return out

    def _map_file(self, i: int) -> MappedFile | None:
        """Shard ``i``'s whole file mapped (its units pages); mapped once and kept until
        :meth:`close`, ``None`` where it cannot be."""
        if i in self._maps:
            return self._maps[i]
        fd = self._fd(i)
        with self._lock:
            if i not in self._maps and sum(got is not None for got in self._maps.values()) >= MAX_MAPPED_FILES:
                self._maps[i] = None
            if i not in self._maps:
                self._maps[i] = MappedFile.open(fd)
            return self._maps[i]

    def _decode_records(self, i: int, start: int, data: memoryview, offs: list[int], sizes: list[int],
                        arrays: Sequence[np.ndarray], which: list[int], row: list[int], jobs: list[DecodeJob]) -> None:
        """Decode the records of shard ``i`` whose streams are ``data[offs[k] : offs[k] + sizes[k]]``
        (``data`` begins at byte ``start`` of the shard) into rows ``arrays[which[k]][row[k]]``: on the
        decode threads when there are some, in jobs appended to ``jobs`` (the caller waits for them with
        :func:`finish_decodes` before its rows are used), else here. For a reader that receives one
        run at a time (a response of the object store); :meth:`_read_compressed` groups runs itself."""
        batcher = _DecodeJobs(self, arrays, jobs, len(offs))
        batcher.add(i, start, data, offs, sizes, which, row)
        batcher.flush()

    def _decode_pool(self) -> DecodeThreads | None:
        """The decode threads (started on first use), or None to decode in the reading thread."""
        if self.decode_workers <= 0:
            return None
        pool = self._decoders
        if pool is None:
            with self._lock:
                pool = self._decoders
                if pool is None:
                    pool = self._decoders = DecodeThreads(self.decode_workers, "shardkit-decode")
        return pool

    def _decode_targets(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The destination buffers as the rows a decoder writes: ``[n, *record_shape]`` of the record
        dtype for an image or audio codec (its stream decodes into the record's shape), else the
        buffers themselves (uint8 rows). Made once per read, not once per record."""
        assert self.codec is not None
        if not (self.decode and self.codec.array_to_bytes):
            return list(arrays)
        out = []
        for a in arrays:
            v = a.view(self.dtype)
            v.shape = (a.shape[0], *self.record.shape)  # a view or an error, never a silent copy
            out.append(v)
        return out

    def _decode_segments(self, segments: list[_Segment], targets: list[np.ndarray]) -> None:
        """Decode every record of ``segments`` into its row of ``targets`` (see :meth:`_decode_targets`),
        in one loop: a failing record is a CorruptShardError naming its shard and record."""
        codec = self.codec
        assert codec is not None
        if not self.decode:
            for i, start, data, offs, sizes, which, row in segments:
                for off, size, w, r in zip(offs, sizes, which, row):
                    self._keep_stored(i, start + off, data[off : off + size], targets[w][r])
            return
        decode = codec.decode
        for i, start, data, offs, sizes, which, row in segments:
            for off, size, w, r in zip(offs, sizes, which, row):
                out = targets[w][r]
                try:
                    decode(data[off : off + size], out)
                except Exception as exc:
                    raise decode_error(self._shard_str(i), self._record_name(i, start + off), out.nbytes, exc) from None

    def _keep_stored(self, i: int, offset: int, data: bytes | memoryview, out: np.ndarray) -> None:
        """The stored bytes of a record into its row (``decode`` off), zeros after them."""
        flat = out.reshape(-1).view(np.uint8)
        n = len(data)
        if n > flat.nbytes:
            raise CorruptShardError(f"{self._shard_str(i)}: {self._record_name(i, offset)} is stored in {n} bytes, more than "
                                    f"the {flat.nbytes} bytes of a decoded record: it cannot be handed over undecoded")
        flat[:n] = np.frombuffer(data, np.uint8)
        flat[n:] = 0

    def _record_name(self, i: int, offset: int) -> str:
        """Shard ``i``'s record stored at byte ``offset``, for messages (looked up in the index only
        when a message needs it, so the read path carries no record numbers)."""
        info = self.shards[i]
        slots = np.flatnonzero(self.index(i).offsets[: info.count] == offset)
        record = f"record {info.start + int(slots[0])}" if slots.size else "the record"
        return f"shard {i} (records {info.start}-{info.stop - 1}): {record} at offset {offset}"

    def can_copy_to_file(self) -> bool:
        """True when :meth:`copy_to_file` can copy records without passing them through user space:
        local shard files of a dataset (every record present), uncompressed, and records large enough
        (:data:`SCATTER_MIN_BYTES`) that a system call per record costs less than copying it."""
        return (type(self) is PayloadArray and self.codec is None and self.record_nbytes >= SCATTER_MIN_BYTES
                and all(info.nbytes >= 0 for info in self.shards))  # fmt: skip

    def announce(self, keys: np.ndarray) -> None:
        """``POSIX_FADV_WILLNEED`` for the runs of records ``keys`` (ascending, distinct), from another thread."""
        if self.codec is None and type(self) is PayloadArray:
            self._announce(self._copy_plan(keys, 0))

    def _copy_plan(self, keys: np.ndarray, first_row: int) -> _Plan:
        """The plan of :meth:`copy_to_file` (checked keys, rows from ``first_row``)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.size and (int(keys[0]) < 0 or int(keys[-1]) >= self.num_records or np.any(np.diff(keys) <= 0)):
            raise ConfigError(f"{self.path}: copy_to_file needs ascending distinct keys in [0, {self.num_records})")
        rows = np.arange(first_row, first_row + keys.size, dtype=np.int64)
        return self._plan(keys, np.zeros(keys.size, dtype=np.int64), rows, [])

    def copy_to_file(self, keys: np.ndarray, fd: int, first_row: int = 0, announce: bool = True) -> None:
        """Copy records ``keys`` (ascending, distinct) into the file ``fd``, record ``keys[j]`` at byte
        ``(first_row + j) * record_nbytes``, inside the kernel (``sendfile``), planned and announced
        (unless ``announce`` is false) as :meth:`read_into`. Only where :meth:`can_copy_to_file` is true."""
        if np.size(keys) == 0:
            return
        if not self.can_copy_to_file():
            raise ConfigError(f"{self.path}: records of this array cannot be copied inside the kernel")
        rec = self.record_nbytes
        plan = self._copy_plan(keys, first_row)
        if announce and plan.num_runs > 1:
            self._announce(plan)
        # Pieces: records contiguous in their shard and in the destination.
        head = np.ones(plan.size, dtype=bool)
        head[1:] = (plan.gap[1:] != 0) | plan.new_shard[1:] | (plan.row[1:] != plan.row[:-1] + 1)
        starts = np.flatnonzero(head)
        counts = np.diff(np.append(starts, plan.size))
        for a, count in zip(starts.tolist(), counts.tolist()):
            i = int(plan.shard[a])
            src, path = self._fd(i), self._shard_str(i)
            off, nbytes, out = int(plan.offs[a]), count * rec, int(plan.row[a]) * rec
            done = 0
            while done < nbytes:
                os.lseek(fd, out + done, os.SEEK_SET)
                n = os.sendfile(fd, src, off + done, nbytes - done)
                if n <= 0:
                    raise TruncatedShardError(f"{path}: expected {nbytes} bytes at offset {off}, the file ended after {done}")
                done += n
            self.stats.add(path, off, nbytes)
        self.stats.add_records(plan.size)

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Records ``[start, stop)`` in storage order (one sequential read per shard)."""
        return self.read(np.arange(start, stop, dtype=np.int64), out)

    def memmap(self, i: int) -> np.memmap:
        """Zero-copy view ``[count, *record_shape]`` of uncompressed shard ``i``."""
        if not self.is_dense(i):
            raise ConfigError(
                f"{self.shard_path(i)}: memmap needs the uncompressed fixed-size layout, "
                f"found compression {self.codec.name if self.codec else 'none'} or a non-dense index"
            )
        count = self.shards[i].count
        return np.memmap(self.shard_path(i), dtype=self.dtype, mode="r", shape=(count, *self.record.shape))

    def close(self) -> None:
        """Close every open shard file and stop the decode threads."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            pool, self._decoders = self._decoders, None
            maps, self._maps = self._maps, {}
        if pool is not None:
            pool.shutdown(wait=True)
        for got in maps.values():
            if got is not None:
                got.close()  # a slice still held: unmapped with the last one

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def read_distinct_parts(parts: Sequence[PayloadArray], distinct: Sequence[np.ndarray], first: Sequence[np.ndarray],
                        dest: Destination, rows: list[np.ndarray]) -> None:  # fmt: skip
    """Records ``distinct[k]`` of ``parts[k]`` (ascending, distinct, checked) into rows
    ``dest.rows[first[k]]`` of ``rows[dest.which[first[k]]]``, like :meth:`PayloadArray.read_distinct`
    per part but read as one plan: each part plans its own shards and the plans are read together, so
    the per-request bookkeeping (announcing, scattering) runs once per block, not once per part (a
    mixture's block then costs what one dataset's does). Parts of one record size, uncompressed, whose
    reads count in one set of counters (the first part's); anything else is read part by part."""
    lead = parts[0]
    one = all(p.codec is None and p.record_nbytes == lead.record_nbytes for p in parts)
    if not one or sum(int(d.size) for d in distinct) > PLAN_RECORDS:
        for p, d, f in zip(parts, distinct, first):
            if d.size:
                p.read_distinct(d, f, dest, rows)
        return
    lead._check_stop()
    plans = [(p, p._plan(d, *dest.rows_at(f), rows)) for p, d, f in zip(parts, distinct, first) if d.size]
    plans = [(p, plan) for p, plan in plans if plan.size]
    if len(plans) <= 1:
        for p, plan in plans:
            p._read_plan(plan, rows, dest.decodes)
        return
    # Shard j of the k-th plan is shard bases[k] + j of the whole; its file is its own part's.
    bases, starts, base, start = [], [], 0, 0
    for _, plan in plans:
        bases.append(base)
        starts.append(start)
        base += int(plan.shard.max()) + 1
        start += plan.size
    owners = [p for p, _ in plans]

    def files(g: int) -> tuple[int, str]:
        k = bisect.bisect_right(bases, g) - 1
        return owners[k]._fd(g - bases[k]), owners[k]._shard_str(g - bases[k])

    def joined(name: str, shift: Sequence[int] | None = None) -> np.ndarray:
        arrays = [getattr(plan, name) for _, plan in plans]
        return np.concatenate(arrays if shift is None else [a + s for a, s in zip(arrays, shift)])

    combined = _Plan(joined("shard", bases), joined("offs"), joined("sizes"), joined("which"), joined("row"),
                     joined("new_shard"), joined("gap"), joined("run_starts", starts), files)  # fmt: skip
    lead._read_plan(combined, rows, dest.decodes)
