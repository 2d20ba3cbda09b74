"""``PayloadArray.read_into``: records read straight into rows of several destination buffers.

The destination API generalises ``read(keys, out)``: every layout (large records scattered with one
``iovec`` each, small records through the bounce buffer, compressed records decoded in place) must put
record ``keys[j]`` exactly into ``buffers[which[j]][rows[j]]`` and touch nothing else.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError
from shardkit.formats import open_dataset
from shardkit.formats.reader import BUFFER_ALIGNMENT, MAP_AHEAD_BYTES, SCATTER_MIN_BYTES, Destination, aligned_empty, map_ahead
from tests.helpers.datasets import make_records, write_dataset

# (record shape, compression): small records (bounce path), large ones (one iovec each), compressed.
LAYOUTS = {
    "small": ((4, 3, 3), None),
    "large": ((SCATTER_MIN_BYTES // 8 + 16, 8), None),
    "zstd": ((4, 3, 3), "zstd"),
}


def _dataset(tmp_path: Path, layout: str, n: int = 61) -> tuple[Path, np.ndarray]:
    shape, compression = LAYOUTS[layout]
    recs = make_records(n, shape=shape)
    return write_dataset(tmp_path / layout, recs, records_per_shard=7, compression=compression), recs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gap", [0, 1 << 16])
def test_records_land_in_their_rows(tmp_path: Path, layout: str, gap: int) -> None:
    path, recs = _dataset(tmp_path, layout)
    n = recs.shape[0]
    rng = np.random.default_rng(3)
    with open_dataset(path, gap_bytes=gap) as ds:
        for _ in range(6):
            k = int(rng.integers(1, 3 * n))
            keys = rng.integers(0, n, size=k)  # duplicates included
            sizes = [int(rng.integers(1, k + 2)) for _ in range(3)]
            buffers = tuple(ds.payload.empty(m + k) for m in sizes)
            for b in buffers:
                b[...] = 0xAB if b.dtype == np.uint8 else 0
            which = rng.integers(0, 3, size=k)
            # distinct rows per buffer, so every destination is written once
            rows = np.empty(k, dtype=np.int64)
            for w in range(3):
                sel = np.flatnonzero(which == w)
                rows[sel] = rng.permutation(buffers[w].shape[0])[: sel.size]
            before = [b.copy() for b in buffers]
            ds.payload.read_into(keys, Destination(buffers, which, rows))
            for w in range(3):
                untouched = np.ones(buffers[w].shape[0], dtype=bool)
                sel = np.flatnonzero(which == w)
                untouched[rows[sel]] = False
                np.testing.assert_array_equal(buffers[w][rows[sel]], recs[keys[sel]])
                np.testing.assert_array_equal(buffers[w][untouched], before[w][untouched])


def test_read_is_read_into_one_buffer(tmp_path: Path) -> None:
    path, recs = _dataset(tmp_path, "small")
    keys = np.array([5, 3, 3, 60, 0, 5])
    with open_dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read(keys), recs[keys])
        out = ds.payload.empty(10)
        assert ds.payload.read(keys, out) is out
        np.testing.assert_array_equal(out[:6], recs[keys])


@pytest.mark.parametrize("layout", ["small", "large"])
def test_dense_read_into_consecutive_rows_is_one_request_per_shard(tmp_path: Path, layout: str) -> None:
    """Consecutive keys into consecutive rows (filling a cache in storage order): one request per
    shard, with no per-record split, for large records too."""
    path, recs = _dataset(tmp_path, layout)
    with open_dataset(path, gap_bytes=0) as ds:
        for i in range(len(ds.payload.shards)):
            ds.payload.index(i)
        calls = ds.payload.stats.read_calls
        out = ds.payload.empty(recs.shape[0])
        ds.payload.read_into(np.arange(recs.shape[0]), Destination.rows_of(out, recs.shape[0]))
        np.testing.assert_array_equal(out, recs)
        assert ds.payload.stats.read_calls - calls == len(ds.payload.shards)


def test_bad_destinations(tmp_path: Path) -> None:
    path, _ = _dataset(tmp_path, "small")
    with open_dataset(path) as ds:
        pa = ds.payload
        good = pa.empty(4)
        cases = [
            Destination((good,), np.zeros(3, np.int64), np.arange(3)),  # 3 rows for 4 keys
            Destination((good,), np.zeros(4, np.int64), np.array([0, 1, 2, 4])),  # row past the end
            Destination((good,), np.array([0, 0, 0, 1]), np.arange(4)),  # no buffer 1
            Destination((np.zeros((4, 4, 3, 3), np.int16),), np.zeros(4, np.int64), np.arange(4)),  # dtype
            Destination((good[:, ::-1],), np.zeros(4, np.int64), np.arange(4)),  # not contiguous
        ]
        for dest in cases:
            with pytest.raises(ConfigError, match="destination"):
                pa.read_into(np.arange(4), dest)
        with pytest.raises(IndexError, match="outside"):
            pa.read_into(np.array([0, 1, 2, 99]), Destination.rows_of(good, 4))
        # One buffer declared as runs of 3 rows: row 3 would be the next buffer's (rows_at skips
        # the division for one buffer, so the check must not rely on it).
        big = pa.empty(8)
        with pytest.raises(ConfigError, match="consecutive"):
            pa.read_into(np.arange(4), Destination((big,), np.zeros(4, np.int64), np.arange(4), (0, 3)))


def test_a_plan_knows_whether_its_records_are_on_the_record_grid(tmp_path: Path) -> None:
    """Plans of the fixed-size layout skip the bounce pieces' grid check (their offsets are whole
    records); a bare array's plan (index offsets) does not."""
    path, recs = _dataset(tmp_path, "small")
    with open_dataset(path) as ds:
        pa = ds.payload
        out = pa.empty(20)
        keys = np.arange(0, 60, 3)
        rows = Destination.rows_of(out, keys.size)
        plan = pa._plan(keys, *rows.rows_at(np.arange(keys.size)), [out.reshape(20, -1).view(np.uint8)])
        assert plan.grid
        np.testing.assert_array_equal(pa.read(keys), recs[keys])
        pa._dense_shard = lambda i, local: False  # type: ignore[method-assign]  # as a bare array: index offsets
        plan = pa._plan(keys, *rows.rows_at(np.arange(keys.size)), [out.reshape(20, -1).view(np.uint8)])
        assert not plan.grid


def test_buffers_are_page_aligned() -> None:
    for n in (1, 3, 100):
        a = aligned_empty(n, (5, 7), np.dtype(np.float32))
        assert a.shape == (n, 5, 7) and a.dtype == np.float32 and a.flags.c_contiguous
        assert a.ctypes.data % BUFFER_ALIGNMENT == 0


def _resident_pages(a: np.ndarray) -> tuple[int, int]:
    """(pages of ``a`` in memory, pages of ``a``), from ``mincore(2)``."""
    page = mmap.PAGESIZE
    n = -(-a.nbytes // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and mincore as Linux has them")
def test_a_large_buffer_is_mapped_before_it_is_written() -> None:
    """A batch-sized buffer's pages are mapped when it is made (one madvise), not one fault at a time
    by the threads that write it first (the decode threads of JPEG records)."""
    probe = aligned_empty(1, (MAP_AHEAD_BYTES,), np.dtype(np.uint8))
    if not map_ahead(probe.ctypes.data, probe.nbytes):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    a = aligned_empty(400, (224, 224, 3), np.dtype(np.uint8))  # 60 MB: above glibc's mmap threshold, fresh pages
    resident, pages = _resident_pages(a)
    assert resident == pages
    small = aligned_empty(1, (MAP_AHEAD_BYTES // 2,), np.dtype(np.uint8))
    assert small.ctypes.data % BUFFER_ALIGNMENT == 0  # below the threshold: left to the allocator


def test_scatter_rows_matches_a_record_by_record_copy() -> None:
    """The grouped scatter of the bounce path puts every record where a plain loop would."""
    from shardkit.formats.reader import _scatter_rows

    rng = np.random.default_rng(11)
    for trial in range(20):
        nbuf = int(rng.integers(1, 6))
        sizes = rng.integers(1, 40, size=nbuf)
        k = int(rng.integers(0, 60))
        which = rng.integers(0, nbuf, size=k) if trial % 4 else np.zeros(k, dtype=np.int64)
        which = np.minimum(which, nbuf - 1)
        row = np.array([rng.integers(0, sizes[w]) for w in which.tolist()], dtype=np.int64)
        # distinct destinations: a record's row is written once
        _, first = np.unique(which * 1000 + row, return_index=True)
        which, row = which[np.sort(first)], row[np.sort(first)]
        piece = rng.integers(0, 256, size=(which.size, 5), dtype=np.uint8)
        got = [np.zeros((int(s), 5), dtype=np.uint8) for s in sizes]
        want = [np.zeros((int(s), 5), dtype=np.uint8) for s in sizes]
        _scatter_rows(got, which, row, piece)
        for j, (w, r) in enumerate(zip(which.tolist(), row.tolist())):
            want[w][r] = piece[j]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_small_sparse_records_are_not_read_one_iovec_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records far smaller than a page, half of them wanted, go through the bounce buffer: an ``iovec``
    per 32-byte record cost more Python time than copying the run (issue #34); the bytes are the same."""
    from shardkit.formats.reader import PayloadArray

    recs = make_records(400, shape=(32,))
    path = write_dataset(tmp_path / "tiny", recs, records_per_shard=200)
    scattered: list[int] = []
    real = PayloadArray._read_scattered

    def spy(self: PayloadArray, plan: object, rows: list[np.ndarray], runs: np.ndarray) -> None:
        scattered.append(int(runs.size))
        real(self, plan, rows, runs)  # type: ignore[arg-type]

    monkeypatch.setattr(PayloadArray, "_read_scattered", spy)
    keys = np.random.default_rng(5).permutation(400)[:190]  # under half of every shard's records
    with open_dataset(path) as ds:
        out = ds.payload.read(keys)
    np.testing.assert_array_equal(out, recs[keys])
    assert sum(scattered) == 0


def test_a_dense_shard_index_is_checked_once_and_not_kept(tmp_path: Path) -> None:
    """The fixed-size layout's index (16 bytes a record) is read and checked at the first read of its
    shard, then offsets are computed: a reader of 10^8 records would otherwise hold 1.6 GB of
    indexes (issue #34). Compressed shards keep theirs."""
    path, recs = _dataset(tmp_path, "small")
    rng = np.random.default_rng(8)
    with open_dataset(path) as ds:
        for _ in range(4):
            keys = rng.permutation(recs.shape[0])[:40]
            np.testing.assert_array_equal(ds.payload.read(keys), recs[keys])
        assert ds.payload._indexes == {}
        assert ds.payload.is_dense(0)
    zpath, zrecs = _dataset(tmp_path, "zstd")
    with open_dataset(zpath) as ds:
        np.testing.assert_array_equal(ds.payload.read(np.arange(10)), zrecs[:10])
        assert ds.payload._indexes



def test_a_canonical_dense_index_is_compared_not_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index byte for byte the fixed-size layout's (crc32c and the recorded one included) is
    accepted by one comparison: decoding 16 bytes a record of every shard was most of the wait for the
    first batch of 10^7 small records (issue #34). Any other index is decoded and refused as before."""
    from shardkit.errors import CorruptIndexError
    from shardkit.formats.index import ShardIndex

    path, recs = _dataset(tmp_path, "small")
    real = ShardIndex.decode
    decoded: list[str] = []

    def counted(*args: object, **kwargs: object) -> ShardIndex:
        decoded.append(str(kwargs.get("path")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardIndex, "decode", counted)
    with open_dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read(np.arange(recs.shape[0])[::-1]), recs[::-1])
        assert decoded == [] and ds.payload._dense_checks == {}  # every page of every shard compared: nothing kept
    # Entry 2 of shard 1 moved by one byte, its crc32c recomputed: decoded, and refused.
    with open_dataset(path) as ds:
        cap, rec, shard = ds.payload.records_per_shard, ds.payload.record_nbytes, ds.payload.shard_path(1)
    index = ShardIndex.dense(7, cap, rec)
    index.offsets[2] += 1
    data = shard.read_bytes()
    isize = len(index.encode())
    shard.write_bytes(data[:-isize] + index.encode())
    with open_dataset(path) as ds, pytest.raises(CorruptIndexError):
        ds.payload.read(np.arange(7, 14))
    assert decoded


def test_buffers_start_the_given_offset_past_a_page() -> None:
    for n in (1, 7, 400):
        a = aligned_empty(n, (224, 224, 3), np.dtype(np.uint8), 16)
        assert a.ctypes.data % BUFFER_ALIGNMENT == 16 and a.flags.c_contiguous and a.base is not None
        a[...] = 7  # every byte of it is writable memory of its own
        assert a.base.nbytes >= a.nbytes + 16


def test_a_sort_keeps_its_positions_as_int32() -> None:
    """A request's sort keeps the positions in int32 below 2**31 keys (4 bytes a block record less,
    issue #34), with the same result as a stable argsort, duplicates included."""
    from shardkit.formats.reader import SortedRequest, SortScratch

    scratch = SortScratch()
    rng = np.random.default_rng(2)
    for keys in (rng.permutation(5000), rng.integers(0, 300, size=5000), np.array([3])):
        keys = keys.astype(np.int64)
        req = SortedRequest.of(keys, 5000, scratch)
        assert req.order.dtype == np.int32
        np.testing.assert_array_equal(req.order, np.argsort(keys, kind="stable"))
        np.testing.assert_array_equal(req.distinct, np.unique(keys))
        np.testing.assert_array_equal(keys[req.first], req.distinct)
