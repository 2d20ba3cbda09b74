"""Blocks of many small records (issue 34): a block read gives up between its chunks once the run is
stopped, and the bounce path's copies stay per record, not per block."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats.reader import Destination, PayloadArray
from shardkit.readers import TieredSampler
from shardkit.stopping import Stopped

#: Records of the dataset below: 16 MiB of 8-byte records, several bounce chunks and plan pieces.
N = 1 << 21


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``N`` records of 8 bytes, record ``i`` holding ``i`` (little-endian int64), 2^18 per shard."""
    path = tmp_path_factory.mktemp("small") / "ds"
    with DatasetWriter(path, kind="test", payload="x", record=FieldSpec((8,), "uint8"), fields={},
                       records_per_shard=1 << 18) as w:  # fmt: skip
        for a in range(0, N, 1 << 20):
            w.write({"x": np.arange(a, min(N, a + (1 << 20)), dtype="<i8").view(np.uint8).reshape(-1, 8)})
    return path


def test_a_block_read_stops_after_the_chunk_it_is_in(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stop event set during a read of a whole shuffled dataset (hundreds of chunks), the read
    raises Stopped after the request it was in, instead of reading every remaining chunk."""
    stop = threading.Event()
    calls: list[bool] = []  # one entry per request: was the stop event set when it was made?
    real = PayloadArray._preadv_all

    def counted(self: PayloadArray, *args: Any) -> None:
        calls.append(stop.is_set())
        real(self, *args)
        stop.set()  # the run is stopped while its first request was being read

    monkeypatch.setattr(PayloadArray, "_preadv_all", counted)
    keys = np.random.default_rng(0).permutation(N)
    out = np.zeros((N, 8), dtype=np.uint8)
    with open_dataset(small) as ds:
        ds.payload.read(np.arange(0, N, 1 << 18))  # opens and checks every shard
        calls.clear()
        stop.clear()
        ds.payload.stop_with(stop)
        with pytest.raises(Stopped):
            ds.payload.read_into(keys, Destination.rows_of(out, N))
    assert calls == [False], f"{len(calls)} requests, {sum(calls)} of them after the stop"


@pytest.mark.parametrize("static_cache", ["auto", 0])  # 0: a staged plan (one staging buffer a block)
def test_closing_a_sampler_during_a_long_block_read_waits_for_one_chunk(small: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       static_cache: str | int) -> None:
    """close() while the block reader is inside a block of hundreds of thousands of records: the
    reader makes at most one more request once the run is stopped (the hook holds the read until
    close() has set the stop flag, so the race is forced, not hoped for). With ``auto`` the cache
    holds the dataset: its files are taken as unmappable, so the records are read (the mapped
    files' reads stop between pieces too: tests/tiers/test_mapped_cache.py)."""
    from shardkit.tiers.mapped import MappedShards

    monkeypatch.setattr(MappedShards, "open", classmethod(lambda cls, payload: None))
    monkeypatch.setattr(PayloadArray, "_cached_map", lambda self, i, local: None)  # the staged block's read, not its gather
    real = PayloadArray._preadv_all
    armed, reached = threading.Event(), threading.Event()
    after_stop: list[int] = []

    def hooked(self: PayloadArray, *args: Any) -> None:
        stop = self._stop
        if threading.current_thread().name == "shardkit-ram-creator" and stop is not None:
            if stop.is_set():
                after_stop.append(1)
            elif armed.is_set() and not reached.is_set():
                reached.set()
                stop.wait(10)  # close() sets it, then waits for this thread
            elif not armed.is_set():
                time.sleep(0.2)  # slow reads: the next block is still being read when the test arms
        real(self, *args)

    monkeypatch.setattr(PayloadArray, "_preadv_all", hooked)
    s = TieredSampler(small, ram_size="32MiB", batch_size=1024, epochs=1, seed=0, static_cache=static_cache)
    assert s.memory_plan.staged == (static_cache == 0)
    it = iter(s)
    first = next(it)
    assert first["x"].shape == (1024, 8)
    del first
    armed.set()
    assert reached.wait(10), "the block reader never made another request"
    s.close()
    assert len(after_stop) <= 1, f"{len(after_stop)} requests after the sampler was closed"


def test_the_bounce_scatter_copies_each_record_without_a_piece_sized_temporary() -> None:
    """The scatter of a bounce chunk into a block's batch buffers puts every record where a plain
    loop would, and allocates less than the chunk's records: no piece-sized gathered copy (about
    90 bytes a 64-byte record before; a buffer's share of a temporary and the int arrays now)."""
    import tracemalloc

    from shardkit.formats.reader import ByteRows, _scatter_rows

    n, rec, nbuf, bs = 1 << 16, 64, 16, 1 << 12
    rng = np.random.default_rng(3)
    dest = rng.permutation(nbuf * bs)[:n]  # distinct rows of the block's buffers
    which, row = (dest // bs).astype(np.int32), (dest % bs).astype(np.int32)
    piece = rng.integers(0, 256, size=(2 * n, rec), dtype=np.uint8)
    take = np.sort(rng.permutation(2 * n)[:n])
    got = ByteRows([np.zeros((bs, rec), dtype=np.uint8) for _ in range(nbuf)])
    _scatter_rows(got, which, row, piece, take)
    for j in rng.integers(0, n, size=2000).tolist():
        np.testing.assert_array_equal(got[int(which[j])][int(row[j])], piece[int(take[j])])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _scatter_rows(got, which, row, piece, take)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 48 * n, f"{peak / n:.0f} bytes allocated per {rec}-byte record"


class _CountedGathers(np.ndarray):
    """An index array that counts the elements gathered from it by fancy indexing."""

    gathered = 0

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        if isinstance(index, np.ndarray) and index.dtype != bool:
            _CountedGathers.gathered += int(np.size(out))
        return out


def test_a_block_of_consecutive_batch_rows_is_read_without_gathering_its_row_arrays(small: Path) -> None:
    """A block's records go to consecutive rows of its batches (``Destination.consecutive``): the
    read computes each piece's buffer and row from the positions, it does not gather them from the
    block-sized ``which``/``rows`` arrays (two cache-missing int gathers per record before)."""
    bs, k = 1000, 300_000
    keys = np.random.default_rng(5).permutation(N)[:k]
    offset = 250  # the block starts inside its first batch
    pos = np.arange(offset, offset + k)
    buffers = tuple(np.zeros((bs, 8), dtype=np.uint8) for _ in range(-(-(offset + k) // bs)))
    which, rows = (pos // bs).view(_CountedGathers), (pos % bs).view(_CountedGathers)
    dest = Destination(buffers, which, rows, (offset, bs))
    with open_dataset(small) as ds:
        ds.payload.read(np.arange(0, N, 1 << 18))
        _CountedGathers.gathered = 0
        ds.payload.read_into(keys, dest)
    assert _CountedGathers.gathered <= 4, f"{_CountedGathers.gathered} row entries gathered for {k} records"
    got = np.concatenate(buffers)[offset : offset + k].view("<i8").reshape(-1)
    np.testing.assert_array_equal(got, keys)


def test_a_destination_whose_rows_are_not_the_runs_it_declares_is_refused() -> None:
    """``consecutive`` must agree with the row arrays (checked at both ends) and the buffers must
    hold the runs: a mismatch is a ConfigError before anything is written."""
    from shardkit.errors import ConfigError

    bufs = (np.zeros((4, 2), np.uint8), np.zeros((4, 2), np.uint8))
    which, rows = np.array([0, 0, 1, 1]), np.array([2, 3, 0, 1])
    Destination(bufs, which, rows, (2, 4)).check(4, (2,), np.dtype(np.uint8), "x")
    with pytest.raises(ConfigError, match="consecutive runs"):
        Destination(bufs, which, rows, (1, 4)).check(4, (2,), np.dtype(np.uint8), "x")
    with pytest.raises(ConfigError, match="consecutive runs"):
        Destination((np.zeros((3, 2), np.uint8), bufs[1]), np.array([0, 1, 1, 1]), np.array([2, 0, 0, 1]),
                    (2, 4)).check(4, (2,), np.dtype(np.uint8), "x")  # fmt: skip


def _staged_keys() -> np.ndarray:
    """Ascending distinct keys of a staged block: dense stretches (several bounce pieces), sparse
    ones (gaps over ``gap_bytes``, and under one record an ``IOVEC_BYTES``) and every shard border."""
    rng = np.random.default_rng(11)
    dense = np.flatnonzero(rng.random(N) < 0.3)
    sparse = np.arange(0, N, 10_000)
    keys = np.concatenate([dense[dense < N // 2], sparse[sparse >= N // 2], [N - 1]])
    return np.unique(keys)


def test_a_staged_block_of_small_records_is_read_without_a_plan(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged block (ascending keys into consecutive rows of one buffer) of a fixed-size layout is
    read piece by piece straight from its keys: no read plan (its per-record arrays were most of
    such a block's reading CPU) for the pieces a plan would read as one run; sparse pieces still
    get one, and every record lands in its row."""
    keys = _staged_keys()
    planned: list[int] = []
    real = PayloadArray._plan

    def counted(self: PayloadArray, keys: np.ndarray, *args: Any) -> Any:
        planned.append(int(keys.size))
        return real(self, keys, *args)

    monkeypatch.setattr(PayloadArray, "_plan", counted)
    out = np.zeros((keys.size, 8), dtype=np.uint8)
    with open_dataset(small) as ds:
        ds.payload.read_into(keys, Destination.rows_of(out, keys.size))
    np.testing.assert_array_equal(out.view("<i8").reshape(-1), keys)
    from shardkit.formats.reader import PLAN_RECORDS

    sparse = int(np.count_nonzero(keys >= N // 2))  # planned, with at most the piece where they begin
    assert 0 < sum(planned) <= sparse + PLAN_RECORDS, f"{sum(planned)} of {keys.size} keys planned ({sparse} sparse)"


def test_a_staged_block_makes_the_requests_its_plan_would(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read without a plan, a staged block asks the file for the same byte ranges, in the same
    order, as the planned read: the same bounce pieces, gaps under ``gap_bytes`` read, larger ones
    skipped (docs/design.md §3), so request counts and the read model do not change. (Shards not in
    the page cache: cached ones are gathered from their mapping, see below.)"""
    monkeypatch.setattr(PayloadArray, "_cached_map", lambda self, i, local: None)
    keys = _staged_keys()
    asked: list[tuple[int, int]] = []
    real = PayloadArray._preadv_all

    def traced(self: PayloadArray, fd: int, path: str, buffers: list[memoryview], offset: int) -> None:
        asked.append((offset, sum(b.nbytes for b in buffers)))
        real(self, fd, path, buffers, offset)

    monkeypatch.setattr(PayloadArray, "_preadv_all", traced)
    got = {}
    for staged in (True, False):
        if not staged:
            monkeypatch.setattr(PayloadArray, "_into_consecutive_rows", lambda self, dest, rows: False)
        out = np.zeros((keys.size, 8), dtype=np.uint8)
        with open_dataset(small) as ds:
            ds.payload.read(np.arange(0, N, 1 << 18))  # opens and checks every shard
            asked.clear()
            ds.payload.read_into(keys, Destination.rows_of(out, keys.size))
        np.testing.assert_array_equal(out.view("<i8").reshape(-1), keys)
        got[staged] = list(asked)
    assert got[True] == got[False]


def _rss_file() -> int:
    """This process's mapped file pages (``RssFile``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_staged_block_of_cached_shards_is_gathered_from_their_mapping(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards whose pages are in the page cache (just written) are not read for a staged block: its
    records are taken from the shard's mapping (a block of small records wants a few records of
    every page, and the read copied every byte), and each window's pages are unmapped after it, so
    the process's mapped file pages stay about one window (they count in its RSS), not the dataset."""
    keys = np.arange(0, N, 3)  # a dense block: every page of every shard wanted
    asked: list[int] = []
    real = PayloadArray._preadv_all

    def traced(self: PayloadArray, fd: int, path: str, buffers: list[memoryview], offset: int) -> None:
        asked.append(offset)
        real(self, fd, path, buffers, offset)

    monkeypatch.setattr(PayloadArray, "_preadv_all", traced)
    out = np.zeros((keys.size, 8), dtype=np.uint8)
    with open_dataset(small) as ds:
        before = _rss_file()
        ds.payload.read(np.arange(N))  # opens and checks every shard and every index page
        asked.clear()
        ds.payload.read_into(keys, Destination.rows_of(out, keys.size))
        grown = _rss_file() - before
        assert ds.payload.stats.bytes_read >= (int(keys[-1]) - int(keys[0])) * 8  # counted as the read would be
    np.testing.assert_array_equal(out.view("<i8").reshape(-1), keys)
    assert asked == [], f"{len(asked)} requests for shards in the page cache"
    assert grown < N * 8 // 4, f"mapped file pages grew by {grown >> 10} KiB for a {N * 8 >> 20} MiB dataset"


def test_a_mapped_gather_stops_after_the_window_it_is_in(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged block gathered from cached shards gives up between windows once the run is stopped,
    as a read does between its requests."""
    from shardkit.formats import reader
    from shardkit.formats.mapping import MappedFile

    stop = threading.Event()
    windows: list[bool] = []
    real = MappedFile.drop

    def counted(self: MappedFile, start: int, end: int) -> None:
        windows.append(stop.is_set())
        real(self, start, end)
        stop.set()

    keys = np.arange(0, N, 2)
    out = np.zeros((keys.size, 8), dtype=np.uint8)
    with open_dataset(small) as ds:
        ds.payload.read(np.arange(0, N, 1 << 18))  # opens and checks every shard
        monkeypatch.setattr(MappedFile, "drop", counted)
        monkeypatch.setattr(reader, "BOUNCE_BYTES", 64 << 10)  # many windows a plan piece
        ds.payload.stop_with(stop)
        with pytest.raises(Stopped):
            ds.payload.read_into(keys, Destination.rows_of(out, keys.size))
    assert windows == [False], f"{len(windows)} windows, {sum(windows)} of them after the stop"
