"""A local uncompressed shard's index is checked a page at a time, as its records are first read
(shardkit/formats/dense_index.py, issue #34): the first records of 10^8 read a few pages of index,
not 1.6 GB, and still no record is delivered before its own index entry was compared."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import CorruptIndexError
from shardkit.formats import ReadStats, open_dataset
from shardkit.formats.dense_index import PIECE_ENTRIES, WHOLE_INDEX_ENTRIES, dense_entries, dense_index_crc32c
from shardkit.formats.index import ShardIndex
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES
from tests.helpers.datasets import make_records, write_dataset

SHARD = 32 * PIECE_ENTRIES  # 8,192 records a shard: an index of 128 KiB, 32 pages (read a page at a time)


def _dataset(tmp_path: Path, shards: int = 4) -> tuple[Path, np.ndarray]:
    recs = make_records(SHARD * shards - 100, shape=(4,))  # the last shard is not full
    return write_dataset(tmp_path / "ds", recs, records_per_shard=SHARD), recs


def test_the_layouts_entries_and_crc_are_the_encoded_index() -> None:
    index = ShardIndex.dense(1000, SHARD, 12).encode()
    assert dense_entries(0, SHARD, 1000, 12).tobytes() == index[:-4]
    assert dense_entries(300, 1200, 1000, 12).tobytes() == index[300 * 16 : 1200 * 16]
    assert dense_index_crc32c(1000, SHARD, 12) == int.from_bytes(index[-4:], "little")


def test_first_reads_check_only_the_pages_of_their_records(tmp_path: Path) -> None:
    assert SHARD > WHOLE_INDEX_ENTRIES  # (a small index is read whole, with the tail: one request)
    """One record of each shard reads one page of each index (and its crc32c and the records'
    tail), not each whole index: the sampler's first block of 10^8 records touches every shard."""
    path, recs = _dataset(tmp_path)
    stats = ReadStats()
    keys = np.array([5, SHARD + 700, 2 * SHARD + 1500, 3 * SHARD + 3])
    with open_dataset(path, stats=stats) as ds:
        np.testing.assert_array_equal(ds.payload.read(keys), recs[keys])
    data = keys.size * recs.shape[1]
    per_shard = PIECE_ENTRIES * 16 + 4 + TAIL_SAMPLE_NBYTES
    assert stats.bytes_read - data == keys.size * per_shard  # whole indexes: 4 x 32 KiB more


def test_every_page_is_read_over_an_epoch_at_most_twice(tmp_path: Path) -> None:
    path, recs = _dataset(tmp_path, shards=2)
    n = recs.shape[0]
    stats = ReadStats(trace=[])
    with open_dataset(path, stats=stats) as ds:
        order = np.random.default_rng(4).permutation(n)
        for block in np.array_split(order, 9):
            np.testing.assert_array_equal(ds.payload.read(block), recs[block])
        assert ds.payload._dense_checks == {} and ds.payload._dense_shards == {0, 1}
    data = {"c/0/0": SHARD * recs.shape[1], "c/1/0": (n - SHARD) * recs.shape[1]}  # where each index starts
    index_bytes = sum(t[2] for t in stats.trace if t[1] >= data[t[0][-5:]] and t[2] != 4)
    # Each index read whole over the epoch; a page compared before is read again only to join two
    # requests (dense_index._GAP_PAGES), so never more than twice.
    assert 2 * SHARD * 16 <= index_bytes <= 2 * 2 * SHARD * 16


def _lie_in_page(path: Path, shard: int, entry: int, keep_crc: bool) -> None:
    """Point ``entry`` of shard ``shard`` at the record before it; the trailer keeps the layout's
    crc32c (which the metadata records) or gets the edited table's."""
    from shardkit.formats.index import crc32c_of

    f = path / f"image/c/{shard}/0"
    raw = bytearray(f.read_bytes())
    start = len(raw) - SHARD * 16 - 4
    table = np.frombuffer(bytes(raw[start:-4]), "<u8").reshape(SHARD, 2).copy()
    table[entry, 0] -= table[entry, 1]
    body = table.tobytes()
    raw[start:-4] = body
    if not keep_crc:
        raw[-4:] = crc32c_of(body).to_bytes(4, "little")
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("keep_crc", [True, False])
def test_a_lie_in_a_page_not_read_yet_is_caught_before_its_record(tmp_path: Path, keep_crc: bool) -> None:
    """The lying entry's page is compared when its record is first asked for: the read is refused
    (the full decode names the problem) and nothing of the record is delivered."""
    path, recs = _dataset(tmp_path)
    lie = 5 * PIECE_ENTRIES + 17
    _lie_in_page(path, 1, lie, keep_crc)
    with open_dataset(path) as ds:
        if keep_crc:  # the shard's size, crc32c and tail are the layout's: its other pages read
            np.testing.assert_array_equal(ds.payload.read([SHARD + 3]), recs[[SHARD + 3]])
        out = np.zeros((1, 4), dtype=recs.dtype)
        with pytest.raises(CorruptIndexError, match=r"image/c/1/0.*crc32c"):
            ds.payload.read([SHARD + lie], out)
        assert not out.any()
        np.testing.assert_array_equal(ds.payload.read([2 * SHARD + lie]), recs[[2 * SHARD + lie]])


def test_a_dense_read_after_sparse_ones_compares_the_pages_left_in_long_requests(tmp_path: Path) -> None:
    """The first blocks of a large epoch check scattered pages; the first dense block compares every
    page left in requests of many pages, not one request per hole they left."""
    path, recs = _dataset(tmp_path, shards=2)
    stats = ReadStats(trace=[])
    with open_dataset(path, stats=stats) as ds:
        sparse = np.arange(0, SHARD, 8 * PIECE_ENTRIES)  # every eighth page of shard 0: holes of seven
        np.testing.assert_array_equal(ds.payload.read(sparse), recs[sparse])
        before = len(stats.trace)
        dense = np.arange(0, SHARD, 2)
        np.testing.assert_array_equal(ds.payload.read(dense), recs[dense])
        assert ds.payload._dense_shards == {0}
    index_reads = [t for t in stats.trace[before:] if t[1] >= SHARD * recs.shape[1]]
    assert len(index_reads) == 1  # the 32-page index: one request


@pytest.mark.parametrize("call", ["is_dense", "memmap"])
def test_is_dense_and_memmap_of_a_partly_checked_shard_keep_no_whole_index(tmp_path: Path, call: str) -> None:
    """After a first read checked one page, ``is_dense``/``memmap`` compare the pages left in bounded
    pieces: neither a whole index (16 MiB here) in memory at once nor one kept afterwards."""
    import tracemalloc

    capacity = 1 << 20  # 16 MiB of index for 3,000 records
    recs = make_records(3000, shape=(4,))
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=capacity)
    with open_dataset(path) as ds:
        payload = ds.payload
        np.testing.assert_array_equal(payload.read([7]), recs[[7]])  # one page of the index checked
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            if call == "is_dense":
                assert payload.is_dense(0)
            else:
                np.testing.assert_array_equal(payload.memmap(0), recs)
            kept, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - base < 4 << 20, f"peak {peak - base} bytes while checking a {16 * capacity}-byte index"
        assert kept - base < 1 << 20, f"{kept - base} bytes kept after the check"
        np.testing.assert_array_equal(payload.read([2999, 5]), recs[[2999, 5]])
