"""The SSD tier's reservoirs (issue 17): scratch slot files, the in-kernel copy, the double-buffered
copy with its writer thread, and the checks on the way back into RAM."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import ConfigError, TruncatedShardError
from shardkit.formats import Dataset, PayloadArray
from shardkit.formats.reader import ReadStats
from shardkit.order.schedule import block_bounds
from shardkit.readers import TieredSampler, epoch_permutation
from shardkit.stopping import Stopped
from shardkit.tiers import ssd_slots
from shardkit.tiers.pipeline import reservoir_bounds
from shardkit.tiers.ssd import SsdSpace
from shardkit.tiers.ssd_slots import ReservoirSlots, ScratchRecords, SlotWrite
from tests.helpers.sampler_data import collect, make_dataset

BIG = (128, 128, 1)  # 16 KiB records: copied inside the kernel
BIG_REC = int(np.prod(BIG))


def _sampler(ds: Path, ssd_dir: Path, **kw: object) -> TieredSampler:
    return TieredSampler(ds, tiers="ram,ssd", ram_size="6records", ssd_size="14records", ssd_dir=ssd_dir,
                         batch_size=4, seed=3, **kw)  # type: ignore[arg-type]


def test_kernel_copy_reads_each_record_once_in_ascending_offsets(tmp_path: Path, ssd_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Large uncompressed local records go to SSD by sendfile: every epoch a permutation, each record's
    bytes read from the dataset once per epoch, ascending offsets within every reservoir, no user-space
    read of the dataset at all, and every batch holds the right bytes."""
    n, epochs = 41, 2
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    calls: list[tuple[int, int, int]] = []
    real_sendfile = os.sendfile

    def counting(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        calls.append((in_fd, offset or 0, count))
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", counting)
    read_into_calls: list[str] = []
    real_read_into = PayloadArray.read_into

    def tracking(self: PayloadArray, keys: np.ndarray, dest: object) -> None:
        read_into_calls.append(type(self).__name__)
        real_read_into(self, keys, dest)  # type: ignore[arg-type]

    monkeypatch.setattr(PayloadArray, "read_into", tracking)
    real_scratch = ScratchRecords.read_into

    def scratch_tracking(self: ScratchRecords, keys: np.ndarray, dest: object) -> None:
        read_into_calls.append(type(self).__name__)
        real_scratch(self, keys, dest)  # type: ignore[arg-type]

    monkeypatch.setattr(ScratchRecords, "read_into", scratch_tracking)
    trace: list[tuple[str, int, int]] = []
    real_copy = PayloadArray.copy_to_file

    def marking(self: PayloadArray, *args: object, **kw: object) -> None:
        trace.append(("PASS", 0, 0))  # one call per reservoir here (far below KERNEL_CHUNK_BYTES)
        real_copy(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PayloadArray, "copy_to_file", marking)
    announcers: list[str] = []
    real_announce = PayloadArray.announce

    def announcing(self: PayloadArray, keys: np.ndarray) -> None:
        announcers.append(threading.current_thread().name)
        real_announce(self, keys)

    monkeypatch.setattr(PayloadArray, "announce", announcing)
    s = _sampler(ds, ssd_dir, epochs=epochs, static_cache=0, gap_bytes=0)
    s.stats.disk.trace = trace
    keys = np.concatenate(collect(s)).reshape(epochs, n)  # collect checks every batch's bytes
    for e in range(epochs):
        assert sorted(keys[e].tolist()) == list(range(n))
    assert calls, "the in-kernel copy was not used"
    # Reads are announced by the writer thread, so the copying thread does not pay for them.
    assert announcers and all(t.startswith("shardkit-ssd-writer") for t in announcers)
    assert "PayloadArray" not in read_into_calls  # the dataset itself is never read through user space
    assert "ScratchRecords" in read_into_calls  # reservoirs are read back into the batch buffers
    data = [t for t in trace if t[0] != "PASS" and t[2] % BIG_REC == 0]
    assert sum(t[2] for t in data) == epochs * n * BIG_REC == s.stats.ssd_bytes_written
    covered: dict[tuple[str, int], int] = defaultdict(int)
    for f, off, nb in data:
        for r in range(off // BIG_REC, (off + nb) // BIG_REC):
            covered[(f, r)] += 1
    assert len(covered) == n and set(covered.values()) == {epochs}
    # Each reservoir is one ascending pass: within a reservoir, offsets never go back in a file.
    passes = 0
    last: dict[str, int] = {}
    for f, off, nb in trace:
        if f == "PASS":
            passes, last = passes + 1, {}
        elif nb % BIG_REC == 0:
            assert off >= last.get(f, 0), (f, off, last)
            last[f] = off + nb
    assert passes >= epochs * 3  # several reservoirs per epoch
    assert s.stats.ssd.records == epochs * n


def _slots(tmp_path: Path, ssd_dir: Path, n: int, copy_records: int) -> tuple[Dataset, SsdSpace, ReservoirSlots]:
    ds = Dataset(make_dataset(tmp_path / "ds", n, records_per_shard=4))
    space = SsdSpace(ssd_dir)
    return ds, space, ReservoirSlots(space, ds.payload, copy_records * ds.record_nbytes)


def test_buffered_copy_overlaps_reading_and_writing(tmp_path: Path, ssd_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records go through the copy buffer: while the writer thread writes chunk c, the creator
    already reads chunk c + 1. Each write waits (bounded) for the next read to start: without the
    overlap every wait would run out, and the log would show the read after the write."""
    ds, space, slots = _slots(tmp_path, ssd_dir, 30, copy_records=4)  # two halves of 2 records
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    reads = threading.Condition(lock)
    real_read = PayloadArray.read
    real_pwrite = os.pwrite
    writer_threads: set[str] = set()

    def reading(self: PayloadArray, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        with reads:
            log.append(("read", int(np.asarray(keys)[0])))
            reads.notify_all()
        return real_read(self, keys, out)

    def writing(fd: int, data: object, offset: int) -> int:
        writer_threads.add(threading.current_thread().name)
        chunk = offset // ds.record_nbytes
        with reads:  # wait (bounded) for the read of the next chunk; there is none after the last
            reads.wait_for(lambda: sum(e[0] == "read" for e in log) > chunk // 2 + 1, timeout=2.0)
            log.append(("write-end", chunk))
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(PayloadArray, "read", reading)
    monkeypatch.setattr(os, "pwrite", writing)
    keys = np.array([0, 2, 3, 7, 8, 11, 19, 20, 25], dtype=np.int64)
    t0 = time.monotonic()
    try:
        assert slots.write(1, ds.payload, keys, threading.Event()) == keys.size * ds.record_nbytes
        monkeypatch.undo()
        back = slots.records(1, keys.size, ReadStats(), 0).read(np.arange(keys.size))
        np.testing.assert_array_equal(back, ds.payload.read(keys))
    finally:
        slots.close()
        space.close()
        ds.close()
    assert writer_threads and all(t.startswith("shardkit-ssd-writer") for t in writer_threads)
    for c in range(0, keys.size - 2, 2):  # every chunk but the last: the next read began first
        assert log.index(("read", int(keys[c + 2]))) < log.index(("write-end", c)), log
    assert time.monotonic() - t0 < 2.0 + 30  # only the last write may have waited out its timeout


def test_slot_is_rewritten_and_checked_on_the_way_back(tmp_path: Path, ssd_dir: Path) -> None:
    """A slot holds the latest reservoir, read back in any subset; a slot shorter than its reservoir
    (or emptied by a failed write) is a TruncatedShardError, never data."""
    ds, space, slots = _slots(tmp_path, ssd_dir, 30, copy_records=4)
    stop = threading.Event()
    try:
        slots.write(0, ds.payload, np.arange(20, dtype=np.int64), stop)
        slots.write(0, ds.payload, np.array([1, 5, 9], dtype=np.int64), stop)  # a smaller one after it
        res = slots.records(0, 3, ReadStats(), 0)
        np.testing.assert_array_equal(res.read([2, 0]), ds.payload.read([9, 1]))
        os.truncate(slots.paths[0], 2 * ds.record_nbytes)
        with pytest.raises(TruncatedShardError, match="reservoir-0"):
            slots.records(0, 3, ReadStats(), 0)
        stop.set()
        with pytest.raises(Stopped):
            slots.write(0, ds.payload, np.arange(10, dtype=np.int64), stop)
        assert os.path.getsize(slots.paths[0]) == 0  # a write that did not finish leaves nothing to read
    finally:
        slots.close()
        space.close()
        ds.close()


def test_copy_to_file_refuses_what_it_cannot_copy(tmp_path: Path) -> None:
    """The in-kernel copy takes ascending distinct keys of large uncompressed local records only; it
    places record keys[j] at row first_row + j and counts each record once."""
    big = Dataset(make_dataset(tmp_path / "big", 12, records_per_shard=5, shape=BIG))
    small = Dataset(make_dataset(tmp_path / "small", 12))
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert big.payload.can_copy_to_file() and not small.payload.can_copy_to_file()
        for bad in ([3, 1], [2, 2], [-1, 4], [4, 12]):
            with pytest.raises(ConfigError, match="ascending distinct keys"):
                big.payload.copy_to_file(np.array(bad), fd)
        with pytest.raises(ConfigError, match="cannot be copied inside the kernel"):
            small.payload.copy_to_file(np.array([1, 2]), fd)
        keys = np.array([0, 4, 5, 6, 11], dtype=np.int64)  # 4-5 and 5-6 cross a shard boundary
        big.payload.copy_to_file(keys, fd, first_row=2)
        assert big.payload.stats.records == keys.size
        got = np.fromfile(tmp_path / "out", dtype=np.uint8).reshape(-1, *BIG)
        np.testing.assert_array_equal(got[2:], big.payload.read(keys))
    finally:
        os.close(fd)
        big.close()
        small.close()


@pytest.mark.parametrize("shape", [BIG, (4, 4, 1)], ids=["kernel-copy", "buffered"])
def test_ram_creator_reads_back_while_the_next_reservoir_is_written(tmp_path: Path, ssd_dir: Path, shape: tuple[int, ...],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading reservoir 0 back into RAM overlaps with writing reservoir 1: the first read back waits
    (bounded) until the write into the other slot has begun, which only happens if the two creators
    run at once."""
    ds = make_dataset(tmp_path / "ds", 40, records_per_shard=5, shape=shape)
    started: list[int] = []
    overlapped: list[bool] = []
    cond = threading.Condition()
    real_start = ReservoirSlots.start
    real_read_into = ScratchRecords.read_into

    def writing(self: ReservoirSlots, slot: int, *args: object) -> SlotWrite:
        with cond:
            started.append(slot)
            cond.notify_all()
        return real_start(self, slot, *args)  # type: ignore[arg-type]

    def reading(self: ScratchRecords, keys: np.ndarray, dest: object) -> None:
        if not overlapped:
            with cond:
                overlapped.append(cond.wait_for(lambda: len(started) >= 2, timeout=5.0))
        real_read_into(self, keys, dest)  # type: ignore[arg-type]

    monkeypatch.setattr(ReservoirSlots, "start", writing)
    monkeypatch.setattr(ScratchRecords, "read_into", reading)
    s = _sampler(ds, ssd_dir, epochs=1, static_cache=0)
    keys = np.concatenate(collect(s))
    assert sorted(keys.tolist()) == list(range(40))
    assert started[:2] == [0, 1] and overlapped == [True]


def test_reservoir_bounds_grow_then_shrink_at_the_end_of_a_run() -> None:
    """The run's last reservoirs halve back down to ``last`` (the final read-back overlaps nothing);
    without it the reservoirs are block_bounds' growing ones; either way a partition of the
    positions into consecutive runs of at most ``largest``."""
    for start, stop, first, largest in ((0, 5000, 112, 1783), (7, 300, 16, 64), (0, 5, 8, 8), (3, 3, 4, 16)):
        for last in (None, first, 1):
            bounds = reservoir_bounds(start, stop, first, largest, last)
            assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]]
            assert (bounds[0][0], bounds[-1][1]) == (start, stop) if stop > start else bounds == []
            assert all(0 < b - a <= largest for a, b in bounds)
    sizes = [b - a for a, b in reservoir_bounds(0, 5000, 112, 1783, 112)]
    assert sizes[:4] == [112, 224, 448, 896] and sizes[-4:] == [896, 448, 224, 112]
    sizes = [b - a for a, b in reservoir_bounds(0, 5000, 1783, 1783, 112)]  # a later epoch: full from the start
    assert sizes[0] == 1783 and sizes[-3:] == [448, 224, 112]
    assert reservoir_bounds(0, 5000, 112, 1783) == list(block_bounds(0, 5000, 112, 1783))


def test_only_the_runs_last_epoch_ends_with_small_reservoirs(tmp_path: Path, ssd_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Reservoir sizes written per epoch: the first epoch of a two-epoch run ends with full
    reservoirs (the next epoch's fill overlaps its read-back), the last one ends with the first
    size, and the order is the permutation of each epoch whatever the reservoirs."""
    n = 60
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    sizes: list[tuple[int, int]] = []
    real_start = ReservoirSlots.start

    def writing(self: ReservoirSlots, slot: int, payload: object, keys: np.ndarray, stop: threading.Event) -> SlotWrite:
        sizes.append((len(sizes), int(keys.size)))
        return real_start(self, slot, payload, keys, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(ReservoirSlots, "start", writing)
    s = _sampler(ds, ssd_dir, epochs=2, static_cache=0)
    first = s.memory_plan.first_block
    k1 = s.memory_plan.ssd_block
    assert k1 is not None and first < k1
    keys = np.concatenate(collect(s))
    for e in range(2):
        np.testing.assert_array_equal(keys[e * n : (e + 1) * n], epoch_permutation(3, e, n))
    counts = [c for _, c in sizes]
    assert sum(counts) == 2 * n
    cut = next(i for i in range(len(counts) + 1) if sum(counts[:i]) == n)  # the epochs' boundary
    one, two = counts[:cut], counts[cut:]
    assert one[0] == first and one[-2] == k1  # epoch 0 grows and stays large (its last is the remainder)
    assert two[0] == k1 and two[-1] == first and two[-2] == 2 * first  # the run's end shrinks


def test_slots_are_allocated_in_the_background_and_a_failed_write_stops_it(tmp_path: Path, ssd_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """preallocate() allocates the slots' first bytes on its own thread, in the order asked and no
    further than asked, so a first pass rewrites allocated space; a write that fails while it runs
    stops it before the slot is emptied (no allocation lands after the truncation, which would
    leave a slot that looks written)."""
    ds, space, slots = _slots(tmp_path, ssd_dir, 30, copy_records=4)
    rec = ds.record_nbytes
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fallocate

    def logging_fallocate(fd: int, offset: int, length: int) -> None:
        calls.append((slots._fds.index(fd), offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", logging_fallocate)
    monkeypatch.setattr(ssd_slots, "PREALLOCATE_CHUNK_BYTES", 4 * rec)
    try:
        slots.preallocate([(0, 2 * rec), (1, 6 * rec), (0, 6 * rec), (1, 3 * rec)])
        assert slots._allocator is not None
        slots._allocator.join(timeout=30)
        slots.preallocate([(0, 9 * rec)])  # a later call: another thread, from where slot 0 ended
        slots._allocator.join(timeout=30)
        assert calls == [(0, 0, 2 * rec), (1, 0, 4 * rec), (1, 4 * rec, 2 * rec), (0, 2 * rec, 4 * rec),
                         (0, 6 * rec, 3 * rec)]  # fmt: skip
        for p, size in zip(slots.paths, (9 * rec, 6 * rec)):
            assert os.path.getsize(p) == size and os.stat(p).st_blocks * 512 >= size
    finally:
        monkeypatch.setattr(os, "posix_fallocate", real)
        slots.close()
        space.close()
        ds.close()

    ds, space, slots = _slots(tmp_path / "again", ssd_dir, 30, copy_records=4)
    entered, release = threading.Event(), threading.Event()
    real_fallocate = os.posix_fallocate
    threads: set[str] = set()

    def allocating(fd: int, offset: int, length: int) -> None:
        threads.add(threading.current_thread().name)
        entered.set()
        release.wait(timeout=30)
        real_fallocate(fd, offset, length)

    def failing(self: PayloadArray, keys: object, out: object = None) -> np.ndarray:
        assert entered.wait(timeout=30)  # the allocation is under way
        threading.Timer(0.0, release.set).start()  # let it finish its call once the write failed
        raise OSError(5, "injected read failure")

    monkeypatch.setattr(os, "posix_fallocate", allocating)
    monkeypatch.setattr(ssd_slots, "PREALLOCATE_CHUNK_BYTES", 2 * rec)
    monkeypatch.setattr(PayloadArray, "read", failing)
    try:
        slots.preallocate([(0, 20 * rec), (1, 20 * rec)])
        with pytest.raises(OSError, match="injected"):
            slots.write(0, ds.payload, np.arange(10, dtype=np.int64), threading.Event())
        assert slots._allocator is not None and not slots._allocator.is_alive()
        assert os.path.getsize(slots.paths[0]) == 0
        assert threads == {"shardkit-ssd-allocator"}
    finally:
        release.set()
        slots.close()
        space.close()
        ds.close()


def test_next_reservoir_is_read_ahead_while_the_last_chunk_is_copied(tmp_path: Path, ssd_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the next reservoir's keys expected, its first chunk is announced (the device reads it)
    before the current reservoir's last chunk is copied, once: the next write copies it without
    announcing it again. Without an expectation every write announces its own first chunk."""
    from shardkit.tiers import ssd_slots

    ds = Dataset(make_dataset(tmp_path / "ds", 24, records_per_shard=5, shape=BIG))
    monkeypatch.setattr(ssd_slots, "KERNEL_CHUNK_BYTES", 4 * BIG_REC)  # chunks of 4 records
    events: list[tuple[str, tuple[int, ...]]] = []
    cond = threading.Condition()
    real_announce, real_copy = PayloadArray.announce, PayloadArray.copy_to_file
    one, two, three = np.arange(0, 16, 2), np.arange(1, 12, 2), np.arange(12, 20)
    overlapped: list[bool] = []

    def announcing(self: PayloadArray, keys: np.ndarray) -> None:
        real_announce(self, keys)
        with cond:
            events.append(("announce", tuple(np.asarray(keys).tolist())))
            cond.notify_all()

    def copying(self: PayloadArray, keys: np.ndarray, *args: object, **kw: object) -> None:
        if np.array_equal(keys, one[4:]):  # the last chunk of `one`: is `two` being read meanwhile?
            with cond:
                overlapped.append(cond.wait_for(lambda: ("announce", tuple(two[:4].tolist())) in events, timeout=10.0))
        with cond:
            events.append(("copy", tuple(np.asarray(keys).tolist())))
        real_copy(self, keys, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PayloadArray, "announce", announcing)
    monkeypatch.setattr(PayloadArray, "copy_to_file", copying)
    space = SsdSpace(ssd_dir)
    slots = ReservoirSlots(space, ds.payload, 4 * BIG_REC)
    stop = threading.Event()
    try:
        slots.expect(two)
        assert slots.write(0, ds.payload, one, stop) == one.size * BIG_REC
        slots.write(1, ds.payload, two, stop)  # nothing expected after it
        slots.write(0, ds.payload, three, stop)
        for slot, keys in ((0, three), (1, two)):
            got = slots.records(slot, keys.size, ds.payload.stats, 0).read(np.arange(keys.size))
            np.testing.assert_array_equal(got, ds.payload.read(keys))
    finally:
        slots.close()
        space.close()
        ds.close()
    announced = [k for what, k in events if what == "announce"]
    assert overlapped == [True]  # the next reservoir's first chunk was read while the last one was copied
    assert announced.count(tuple(two[:4].tolist())) == 1  # not announced again by the write of `two`
    assert announced.count(tuple(three[:4].tolist())) == 1  # announced by its own write (not expected)
    assert sorted(announced) == sorted([tuple(c) for k in (one, two, three) for c in np.split(k, range(4, k.size, 4))])


def test_ssd_creator_expects_each_next_reservoir(tmp_path: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSD creator tells the slots the keys of the reservoir after the one it writes (what that
    write then copies), so its first chunk is read ahead; nothing after an epoch's last one."""
    n = 40
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    log: list[tuple[str, tuple[int, ...] | None]] = []
    real_expect, real_start = ReservoirSlots.expect, ReservoirSlots.start

    def expecting(self: ReservoirSlots, keys: np.ndarray | None) -> None:
        log.append(("expect", None if keys is None else tuple(keys.tolist())))
        real_expect(self, keys)

    def writing(self: ReservoirSlots, slot: int, payload: object, keys: np.ndarray, stop: threading.Event) -> SlotWrite:
        log.append(("write", tuple(keys.tolist())))
        return real_start(self, slot, payload, keys, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(ReservoirSlots, "expect", expecting)
    monkeypatch.setattr(ReservoirSlots, "start", writing)
    s = _sampler(ds, ssd_dir, epochs=1, static_cache=0)
    keys = np.concatenate(collect(s))
    np.testing.assert_array_equal(keys, epoch_permutation(3, 0, n))
    writes = [k for what, k in log if what == "write"]
    expects = [k for what, k in log if what == "expect"]
    assert len(writes) >= 3 and len(expects) == len(writes)
    assert expects[:-1] == writes[1:] and expects[-1] is None
    assert [what for what, _ in log] == ["expect", "write"] * len(writes)  # each expectation before its write


def test_stats_count_what_each_ssd_stage_waited_for(tmp_path: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stats.wait_seconds``: the RAM tier's wait for a reservoir (forced: the first write starts
    only once the RAM tier asks for it) and the fill's wait for a free slot (forced: the first read
    back begins only once the fill waits for a slot)."""
    from shardkit.tiers.pipeline import Pipeline

    ds = make_dataset(tmp_path / "ds", 40, records_per_shard=5, shape=BIG)
    ram_asks, fill_waits = threading.Event(), threading.Event()
    real_get, real_start, real_read = Pipeline._get, ReservoirSlots.start, ScratchRecords.read_into
    forced: list[bool] = []

    def getting(self: Pipeline, q: Any) -> Any:
        if q is self._ssd_q:
            ram_asks.set()
        elif q is self._ssd_slots and q.empty():
            fill_waits.set()
        return real_get(self, q)

    def writing(self: ReservoirSlots, *args: Any) -> SlotWrite:
        if not forced:
            forced.append(ram_asks.wait(timeout=10.0))
        return real_start(self, *args)

    def reading(self: ScratchRecords, keys: np.ndarray, dest: Any) -> None:
        if len(forced) == 1:
            forced.append(fill_waits.wait(timeout=10.0))
        real_read(self, keys, dest)

    monkeypatch.setattr(Pipeline, "_get", getting)
    monkeypatch.setattr(ReservoirSlots, "start", writing)
    monkeypatch.setattr(ScratchRecords, "read_into", reading)
    s = _sampler(ds, ssd_dir, epochs=1, static_cache=0)
    keys = np.concatenate(collect(s))
    assert sorted(keys.tolist()) == list(range(40)) and forced == [True, True]
    waits = s.stats.wait_seconds
    assert set(waits) == {"ssd", "ssd_fill"} and waits["ssd"] > 0 and waits["ssd_fill"] > 0


@pytest.mark.parametrize("epochs", [1, 2])
def test_slots_are_cut_as_the_runs_last_reservoirs_shrink(tmp_path: Path, ssd_dir: Path, epochs: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the run's final reservoirs halve, each slot read back is cut to the largest reservoir it
    gets later, so the run's close finds both slots empty (their pages were freed while the last
    batches were delivered, not in the consumer's last call); never below a later write, and never
    while the reservoirs still grow."""
    n = 60
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    log: list[tuple[str, int, int]] = []
    at_close: list[int] = []
    real_start, real_shrink, real_close = ReservoirSlots.start, ReservoirSlots.shrink, ReservoirSlots.close

    def writing(self: ReservoirSlots, slot: int, payload: Any, keys: np.ndarray, stop: threading.Event) -> SlotWrite:
        log.append(("write", slot, int(keys.size) * BIG_REC))
        return real_start(self, slot, payload, keys, stop)

    def shrinking(self: ReservoirSlots, slot: int, nbytes: int) -> None:
        log.append(("shrink", slot, nbytes))
        real_shrink(self, slot, nbytes)

    def closing(self: ReservoirSlots) -> None:
        at_close.extend(os.fstat(fd).st_size for fd in self._fds)
        real_close(self)

    monkeypatch.setattr(ReservoirSlots, "start", writing)
    monkeypatch.setattr(ReservoirSlots, "shrink", shrinking)
    monkeypatch.setattr(ReservoirSlots, "close", closing)
    s = _sampler(ds, ssd_dir, epochs=epochs, static_cache=0)
    keys = np.concatenate(collect(s))
    for e in range(epochs):
        np.testing.assert_array_equal(keys[e * n : (e + 1) * n], epoch_permutation(3, e, n))
    assert at_close == [0, 0]
    writes = [nbytes for what, _, nbytes in log if what == "write"]
    first_shrink = next(i for i, (what, _, _) in enumerate(log) if what == "shrink")
    largest = max(writes)
    assert sum(writes) - sum(w for what, _, w in log[first_shrink:] if what == "write") >= (epochs - 1) * n * BIG_REC
    assert largest in [w for what, _, w in log[:first_shrink] if what == "write"]  # the reservoirs stopped growing
    for i, (what, slot, nbytes) in enumerate(log):
        if what == "shrink":
            assert all(w <= nbytes for kind, sl, w in log[i + 1 :] if kind == "write" and sl == slot)


def test_slots_are_allocated_as_far_as_their_reservoirs_need(tmp_path: Path, ssd_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's slots take turns, and each is preallocated up to the largest reservoir it gets,
    not to the largest reservoir of the plan: a short run's first epoch, whose reservoirs grow
    from a small one, allocates no page it does not write."""
    n = 28  # reservoirs of 3, 6, 7, 3, 6 and 3 records: slot 1 never gets the largest (7)
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    written = [0, 0]
    allocated: dict[int, int] = defaultdict(int)
    real_start, real_fallocate = ReservoirSlots.start, os.posix_fallocate

    def writing(self: ReservoirSlots, slot: int, payload: Any, keys: np.ndarray, stop: threading.Event) -> SlotWrite:
        written[slot] = max(written[slot], int(keys.size) * BIG_REC)
        return real_start(self, slot, payload, keys, stop)

    def allocating(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == "shardkit-ssd-allocator":  # not other shared memory
            allocated[fd] = max(allocated[fd], offset + length)
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(ReservoirSlots, "start", writing)
    monkeypatch.setattr(os, "posix_fallocate", allocating)
    s = _sampler(ds, ssd_dir, epochs=1, static_cache=0)
    k1 = s.memory_plan.ssd_block
    assert k1 is not None
    keys = np.concatenate(collect(s))
    np.testing.assert_array_equal(keys, epoch_permutation(3, 0, n))
    assert min(written) < k1 * BIG_REC  # a slot whose reservoirs stay under the largest size
    assert sorted(allocated.values()) == sorted(written)


def test_copy_buffer_is_allocated_only_by_a_buffered_write(tmp_path: Path, ssd_dir: Path) -> None:
    """The in-kernel copy needs no copy buffer, so none is made (its pages would be mapped on the
    run's first call); the first buffered write makes its two halves."""
    for name, shape, buffered in (("big", BIG, False), ("small", (4, 4, 1), True)):
        ds = Dataset(make_dataset(tmp_path / name, 12, records_per_shard=4, shape=shape))
        space = SsdSpace(ssd_dir)
        slots = ReservoirSlots(space, ds.payload, 4 * ds.record_nbytes)
        try:
            assert slots._buffers == []
            keys = np.arange(0, 12, 2, dtype=np.int64)
            slots.write(0, ds.payload, keys, threading.Event())
            assert [b.shape[0] for b in slots._buffers] == ([2, 2] if buffered else [])
            out = ds.payload.empty(keys.size)
            slots.records(0, keys.size, ReadStats(), 0).read(np.arange(keys.size), out)
            np.testing.assert_array_equal(out, ds.payload.read(keys))
        finally:
            slots.close()
            space.close()
            ds.close()
