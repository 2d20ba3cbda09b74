"""A static cache that holds a local uncompressed dataset whole is its mapped shard files
(shardkit/tiers/mapped.py): no rows of its own, the same order and records, storage read once."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from shardkit.readers import TieredSampler
from shardkit.stopping import Stopped
from shardkit.tiers import mapped as mapped_mod
from tests.helpers.sampler_data import epochs_of, make_dataset

N, RPS, SHAPE = 90, 16, (32, 32, 4)  # 4 KiB records: page-sized, over 6 shards
REC = int(np.prod(SHAPE))


def _sampler(path: Path, **kw: object) -> TieredSampler:
    return TieredSampler(path, batch_size=8, epochs=1, seed=5, ram_size=f"{3 * N}records", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("node_sharing", [True, False])
def test_a_cache_of_the_whole_dataset_is_its_mapped_files(tmp_path: Path, node_sharing: bool) -> None:
    """Three runs: the order of ``static_cache=0``, the records checked in every batch, no cache
    rows (private or node-shared), the dataset read from storage in the first run only."""
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    s = _sampler(path, node_sharing=node_sharing)
    plain = _sampler(path, static_cache=0)
    try:
        assert s.static_cache == N
        disk = []
        for _ in range(3):
            d0 = s.stats.disk.bytes_read
            np.testing.assert_array_equal(epochs_of(s, N), epochs_of(plain, N))  # epochs_of checks every record
            disk.append(s.stats.disk.bytes_read - d0)
            assert s._cache is not None and s._cache.rows is None and s._cache.mapped is not None
        assert disk[0] >= N * REC and disk[1] == disk[2] == 0  # (and each shard's index, checked as it is mapped)
        assert s.stats.disk.records == N  # each record read once
        assert s.stats.cache.records == 3 * N  # every record of every epoch served by the cache
    finally:
        s.close()
        plain.close()
    assert s._cache.mapped is None  # close() lets go of the mapping


def test_a_mapped_cache_counts_the_records_it_reads_not_whole_pages(tmp_path: Path) -> None:
    """1 KiB records, 5 to a shard: the first epoch counts each record's bytes once, as a read of
    them would (the kernel's whole pages are not the records asked for), and nothing after it."""
    n = 40
    path = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=(16, 16, 4))
    with TieredSampler(path, batch_size=2, epochs=2, seed=8, ram_size=f"{n}records", node_sharing=False) as s:
        assert s.maps_whole_cache
        assert epochs_of(s, n).shape == (2, n)
        assert s.stats.disk_bytes_by_epoch == {0: n * 1024, 1: 0} and s.stats.disk.records == n


def test_a_node_shared_cache_is_the_mapped_files_for_every_consumer(tmp_path: Path) -> None:
    """The default (node-shared) cache of a whole dataset is the mapped files too, and the node's
    record of what is resident goes with it: while one sampler holds the cache (as an adapter's
    dataset does), a later sampler of the node (a DataLoader worker of the next pass, another rank:
    a mapping of its own that made nothing resident) reads nothing from storage; once the last one
    lets go, the next sampler reads the dataset again."""
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    holder = _sampler(path)
    holder.hold_shared()
    plain = _sampler(path, static_cache=0)
    try:
        assert holder.maps_whole_cache
        expected = epochs_of(plain, N)
        for reads in (N, 0, 0):
            s = _sampler(path)
            try:
                np.testing.assert_array_equal(epochs_of(s, N), expected)  # epochs_of checks every record
                assert s._cache is not None and s._cache.rows is None and s._cache.mapped is not None and s._cache.shared
                assert s.stats.disk.records == reads and s.stats.cache.records == N
                assert s.stats.disk.bytes_read >= reads * REC
                if not reads:  # nothing but each shard's index, checked as the shard is mapped
                    assert s.stats.disk.bytes_read < N * REC // 2
            finally:
                s.close()
        holder.close()
        with _sampler(path) as s:  # the node's last user let go: the record of what is resident went with it
            epochs_of(s, N)
            assert s.stats.disk.records == N
    finally:
        holder.close()
        plain.close()


def test_populate_counts_what_no_process_of_the_node_made_resident(tmp_path: Path) -> None:
    """With the node's record of what is resident, ``populate`` maps every record this process
    lacks but counts (and publishes) only those no process made resident before."""
    from shardkit.formats import open_dataset
    from shardkit.formats.reader import ReadStats

    class Node:
        def __init__(self) -> None:
            self.flags = np.zeros(N, dtype=bool)
            self.flags[[3, 17, 40]] = True  # made resident by another process
            self.published: list[list[int]] = []

        def filled(self, rows: np.ndarray) -> np.ndarray:
            out: np.ndarray = self.flags[rows]
            return out

        def publish(self, rows: np.ndarray) -> None:
            self.published.append(rows.tolist())
            self.flags[rows] = True

    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    node = Node()
    with open_dataset(path) as ds:
        m = mapped_mod.MappedShards.open(ds.payload)
        assert m is not None
        stats = ReadStats(trace=[])
        keys = np.array([40, 3, 17, 3, 89, 18], dtype=np.int64)
        m.populate(keys, stats, node=node)
        assert sum(nb for _, _, nb in stats.trace) == 2 * REC and stats.records == 2  # 18 and 89
        assert node.published == [[18], [89]]  # each shard's as its pages are mapped
        assert all(m._files[k // RPS].resident[k % RPS] for k in (3, 17, 18, 40, 89))  # all of them mapped here
        m.populate(np.array([3, 18, 50]), stats, node=node)
        assert stats.records == 3 and node.published[-1] == [50]
        m.close()


@pytest.mark.parametrize("node_sharing", [True, False])
def test_unmappable_files_fall_back_to_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_sharing: bool) -> None:
    """Files that cannot be mapped (remote, compressed, another layout): the cache keeps its own
    rows, as it does for a part of the dataset, with the same order; the record of what the
    mapping made resident, attached already by a holder, is let go."""
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    monkeypatch.setattr(mapped_mod.MappedShards, "open", classmethod(lambda cls, payload: None))
    s = _sampler(path, node_sharing=node_sharing)
    plain = _sampler(path, static_cache=0)
    try:
        s.hold_shared()
        assert s._cache is not None and s._cache.files and s._cache.flags is not None and s._cache.rows is None
        flags_region = s._cache._region
        assert (flags_region is not None) == node_sharing
        for _ in range(2):
            np.testing.assert_array_equal(epochs_of(s, N), epochs_of(plain, N))
        assert s._cache is not None and not s._cache.files and s._cache.rows is not None
        assert s._cache.shared == node_sharing
        if flags_region is not None:
            assert s._cache._region is not flags_region and flags_region._mmap is None  # released
    finally:
        s.close()
        plain.close()


def test_a_dataset_of_too_many_shards_keeps_the_copy_from_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More shards than are mapped: the sampler says its whole cache is not mapped (the profiler's
    model charges the copy's pages) and never tries to map, and its batches are those of the copy."""
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    assert _sampler(path, node_sharing=False).maps_whole_cache
    monkeypatch.setattr(mapped_mod, "MAX_MAPPED_SHARDS", 5)  # the dataset has 6
    monkeypatch.setattr("shardkit.readers.sampler.MAX_MAPPED_SHARDS", 5)
    monkeypatch.setattr(mapped_mod.MappedShards, "open", classmethod(lambda cls, payload: pytest.fail("mapped")))
    s = _sampler(path, node_sharing=False)
    plain = _sampler(path, static_cache=0)
    try:
        assert not s.maps_whole_cache
        np.testing.assert_array_equal(epochs_of(s, N), epochs_of(plain, N))
        assert s._cache is not None and not s._cache.files and s._cache.rows is not None
    finally:
        s.close()
        plain.close()


def test_populate_reads_each_record_once_in_whole_pages(tmp_path: Path) -> None:
    """``populate`` maps only records never made resident, each shard's pages in ranges, and counts
    them; the copies cover every position once, from the right shard and row."""
    from shardkit.formats import open_dataset
    from shardkit.formats.reader import ReadStats

    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    with open_dataset(path) as ds:
        m = mapped_mod.MappedShards.open(ds.payload)
        assert m is not None
        stats = ReadStats(trace=[])
        keys = np.array([40, 3, 17, 3, 89, 18], dtype=np.int64)
        m.populate(keys, stats)
        assert sum(nb for _, _, nb in stats.trace) == 5 * REC  # five distinct records, page sized
        assert len(stats.trace) == 4  # shards 0, 1 (17 and 18 in one range), 2, 5
        m.populate(keys[:3], stats)
        assert len(stats.trace) == 4  # resident already
        stop = threading.Event()
        stop.set()
        with pytest.raises(Stopped):
            m.populate(np.array([50, 70]), stats, stop)  # a stopped run reads nothing more
        assert len(stats.trace) == 4
        expected = ds.payload.read(keys)
        out = np.zeros_like(expected)
        for pos, view, rows in m.copies(keys):
            out[pos] = view[rows]
        np.testing.assert_array_equal(out, expected)
        m.close()


def test_scattered_large_rows_are_gathered_without_a_temporary() -> None:
    """The assembler's gather of scattered batch rows (a block's records from several shard files)
    copies large rows straight into place: nothing the size of a row is allocated."""
    import tracemalloc

    from shardkit.tiers.pipeline import gather_rows

    rec = 64 << 10
    src = np.arange(40 * rec, dtype=np.uint8).reshape(40, rec) * np.uint8(7)
    dst = np.zeros((32, rec), dtype=np.uint8)
    dst_rows, src_rows = np.array([1, 4, 5, 9, 20, 21, 30, 31, 0, 2]), np.array([39, 0, 7, 3, 3, 12, 25, 8, 1, 2])
    tracemalloc.start()
    try:
        gather_rows(dst, dst_rows, src, src_rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(dst[dst_rows], src[src_rows])
    assert peak < rec


def test_populate_announces_every_range_of_a_block_before_it_populates_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold block's pages are asked of the device all at once: ``MADV_WILLNEED`` on every range
    of every shard the block touches comes before the first range is populated (populating alone
    reads one range at a time), and the ranges announced cover the ranges populated."""
    from shardkit.formats import open_dataset
    from shardkit.formats.mapping import MappedFile
    from shardkit.formats.reader import ReadStats

    events: list[tuple[str, int, list[tuple[int, int]]]] = []
    announce, populate = MappedFile.announce, MappedFile.populate
    maps: list[object] = []

    def spy_announce(self: MappedFile, starts: np.ndarray, ends: np.ndarray) -> None:
        events.append(("announce", maps.index(self), list(zip(starts.tolist(), ends.tolist()))))
        announce(self, starts, ends)

    def spy_populate(self: MappedFile, starts: np.ndarray, ends: np.ndarray) -> None:
        events.append(("populate", maps.index(self), list(zip(starts.tolist(), ends.tolist()))))
        populate(self, starts, ends)

    monkeypatch.setattr(MappedFile, "announce", spy_announce)
    monkeypatch.setattr(MappedFile, "populate", spy_populate)
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    with open_dataset(path) as ds:
        m = mapped_mod.MappedShards.open(ds.payload)
        assert m is not None
        maps.extend(m._files)
        m.populate(np.array([40, 3, 17, 89, 18], dtype=np.int64), ReadStats())
        m.close()
    kinds = [k for k, _, _ in events]
    assert kinds == ["announce"] * 4 + ["populate"] * 4, kinds  # shards 0, 1, 2 and 5
    announced = {i: r for k, i, r in events if k == "announce"}
    for _, i, ranges in (e for e in events if e[0] == "populate"):
        for a, b in ranges:
            assert any(x <= a and b <= y for x, y in announced[i]), (i, a, b, announced[i])


def test_jobs_with_different_seeds_share_the_nodes_record_of_what_is_resident(tmp_path: Path) -> None:
    """Which records are resident is the files', not an order's: a job of another seed on the node
    (the first one still holding the cache) reads nothing the first one read from storage."""
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    holder = _sampler(path)
    holder.hold_shared()
    try:
        with _sampler(path) as first:
            epochs_of(first, N)
            assert first.stats.disk.records == N
        other = TieredSampler(path, batch_size=8, epochs=1, seed=6, ram_size=f"{3 * N}records")
        with other:
            assert other.maps_whole_cache
            epochs_of(other, N)  # checks every record
            assert other.stats.disk.records == 0 and other.stats.cache.records == N
    finally:
        holder.close()


def test_blocks_are_announced_ahead_on_a_thread_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the run's second block on, blocks are announced in order on the announcing thread, up to
    ``AHEAD_BLOCKS`` beyond the block the reader populates, and the reader never waits for a later
    block's announcement: here the third block's announcement is held until the second block was
    populated, which a reader that announced the next block itself before populating could not
    reach. Every block is announced once, before its own pages are populated; the run's first
    block waits for nothing else, and each record is read once."""
    from shardkit.order import schedule

    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 8 * REC)
    monkeypatch.setattr(schedule, "MIN_BLOCK_BYTES", 16 * REC)
    events: list[tuple[str, frozenset[int], bool]] = []
    threads: list[str] = []
    held: list[bool] = []
    second_populated = threading.Event()
    announce, populate = mapped_mod.MappedShards.announce, mapped_mod.MappedShards.populate

    def spy_announce(self: mapped_mod.MappedShards, keys: np.ndarray) -> mapped_mod.Lacking:
        threads.append(threading.current_thread().name)
        populated = sum(kind == "populate" for kind, _, _ in events)
        assert len(threads) - populated <= mapped_mod.AHEAD_BLOCKS + 1  # (block k announced once k - AHEAD_BLOCKS is read)
        if len(threads) == 2:  # the third block: released by the second block's populate
            held.append(second_populated.wait(5))
        done = announce(self, keys)
        events.append(("announce", frozenset(keys.tolist()), False))
        return done

    def spy_populate(self: mapped_mod.MappedShards, keys: np.ndarray, *args: object, **kw: object) -> None:
        events.append(("populate", frozenset(keys.tolist()), kw.get("announced") is not None))
        if sum(kind == "populate" for kind, _, _ in events) == 2:
            second_populated.set()
        populate(self, keys, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(mapped_mod.MappedShards, "announce", spy_announce)
    monkeypatch.setattr(mapped_mod.MappedShards, "populate", spy_populate)
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    with _sampler(path, node_sharing=False) as s:
        assert s.maps_whole_cache
        epochs_of(s, N)  # checks every record
        assert s.stats.disk.records == N
    assert held == [True]  # the reader populated the second block while the third was being announced
    assert threads and all(t.startswith("shardkit-announce") for t in threads), threads
    blocks = [(at, keys, ahead) for at, (kind, keys, ahead) in enumerate(events) if kind == "populate"]
    assert len(blocks) >= 4, blocks
    assert events[0][0] == "populate" and not blocks[0][2]  # the first block: announced by its own populate
    announced_at = {keys: at for at, (kind, keys, _) in enumerate(events) if kind == "announce"}
    assert len(announced_at) == sum(kind == "announce" for kind, _, _ in events) == len(blocks) - 1  # each block once
    for at, keys, ahead in blocks[1:]:
        assert ahead and announced_at[keys] < at  # announced before its populate, which announces nothing


def test_a_block_reads_its_own_records_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's populate makes its own records resident, not those between them (blocks complete
    in the order the consumer takes them), counts and publishes them; the block after reads only
    what is still lacking."""
    from shardkit.formats import open_dataset
    from shardkit.formats.mapping import MappedFile
    from shardkit.formats.reader import ReadStats

    announced: list[tuple[int, int]] = []
    announce = MappedFile.announce

    def spy(self: MappedFile, starts: np.ndarray, ends: np.ndarray) -> None:
        announced.extend(zip(starts.tolist(), ends.tolist()))
        announce(self, starts, ends)

    monkeypatch.setattr(MappedFile, "announce", spy)
    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    published: list[int] = []

    class Node:
        def filled(self, rows: np.ndarray) -> np.ndarray:
            return np.isin(rows, published)

        def publish(self, rows: np.ndarray) -> None:
            published.extend(rows.tolist())

    with open_dataset(path) as ds:
        m = mapped_mod.MappedShards.open(ds.payload)
        assert m is not None
        stats = ReadStats()
        m.populate(np.array([10, 0, 4, 15, 16], dtype=np.int64), stats, node=Node())  # 15 and 16 lie in two shards
        assert sorted(published) == [0, 4, 10, 15, 16]
        assert stats.records == 5 and stats.bytes_read == 5 * REC
        assert announced == [(0, REC), (4 * REC, 5 * REC), (10 * REC, 11 * REC), (15 * REC, 16 * REC), (0, REC)]
        assert not m._files[0].resident[1:4].any() and m._files[0].resident[[0, 4, 10]].all()
        lacking = m.announce(np.array([1, 4, 8], dtype=np.int64))  # 4 is resident
        assert [(i, part.tolist()) for i, part, _ in lacking.parts] == [(0, [1, 8])]
        m.populate(np.array([1, 4, 8], dtype=np.int64), stats, node=Node(), announced=lacking)
        assert stats.records == 7


def test_an_epoch_reads_each_block_s_own_records_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block, the run's first (its first batch waits for nothing else) and the ones after it,
    asks the device for its own records only, each record once and in the order of
    ``static_cache=0``: a range a record but where two of a block are neighbours."""
    from shardkit.formats.mapping import MappedFile
    from shardkit.order import schedule

    n = 400  # two shards of 200 records
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 8 * REC)
    monkeypatch.setattr(schedule, "MIN_BLOCK_BYTES", 32 * REC)
    ranges = [0]
    announce = MappedFile.announce

    def spy_announce(self: MappedFile, starts: np.ndarray, ends: np.ndarray) -> None:
        ranges[0] += int(np.count_nonzero(ends > starts))
        announce(self, starts, ends)

    monkeypatch.setattr(MappedFile, "announce", spy_announce)
    path = make_dataset(tmp_path / "ds", n, records_per_shard=200, shape=SHAPE)
    kw: dict[str, object] = dict(batch_size=8, epochs=1, seed=5, ram_size=f"{3 * n}records")
    with TieredSampler(path, static_cache=0, **kw) as plain, TieredSampler(path, node_sharing=False, **kw) as s:  # type: ignore[arg-type]
        assert s.maps_whole_cache
        np.testing.assert_array_equal(epochs_of(s, n), epochs_of(plain, n))  # checks every record
        assert s.stats.disk.records == n
    assert n // 2 < ranges[0] <= n  # (blocks of 32 of 400 records: few neighbours)


def test_blocks_announced_ahead_count_a_shared_record_once(tmp_path: Path) -> None:
    """Two blocks announced before either is populated (an epoch's last block and the next epoch's
    first, which can share records): the second block's populate leaves out what the first made
    resident since, so each record is counted (and read) once."""
    from shardkit.formats import open_dataset
    from shardkit.formats.reader import ReadStats

    path = make_dataset(tmp_path / "ds", N, records_per_shard=RPS, shape=SHAPE)
    with open_dataset(path) as ds:
        m = mapped_mod.MappedShards.open(ds.payload)
        assert m is not None
        stats = ReadStats()
        last, first = np.array([3, 17, 40, 41]), np.array([41, 40, 5, 88])
        announced = [m.announce(last), m.announce(first)]
        m.populate(last, stats, announced=announced[0])
        m.populate(first, stats, announced=announced[1])
        assert stats.records == 6
        assert stats.bytes_read == 6 * REC
        m.close()
