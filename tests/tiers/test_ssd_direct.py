"""The SSD tier's direct reads (issue 33): cold records go from the device straight into the tmpfs
slots' mappings, records in the page cache are copied from it, and a refused or failed direct read
never leaves a slot that looks written."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import Dataset
from shardkit.formats.reader import Destination, ReadStats
from shardkit.profiling.phases import evict_page_cache
from shardkit.readers import TieredSampler
from shardkit.tiers import ssd_direct, ssd_slots
from shardkit.tiers.ssd import SsdSpace
from shardkit.tiers.ssd_direct import DirectReads, on_tmpfs
from shardkit.tiers.ssd_slots import ReservoirSlots
from tests.helpers.sampler_data import collect, make_dataset

BIG = (128, 128, 1)  # 16 KiB records: a multiple of DIRECT_ALIGN
BIG_REC = int(np.prod(BIG))


class _Io:
    """Counts ``sendfile`` calls and the ``preadv`` calls on descriptors opened with ``O_DIRECT``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: int | None = None, refuse: bool = False) -> None:
        self.sendfile = 0
        self.direct: list[tuple[int, int]] = []
        self._fds: set[int] = set()
        self._lock = threading.Lock()
        real_open, real_preadv, real_sendfile = os.open, os.preadv, os.sendfile

        def opening(path: object, flags: int, *args: object, **kw: object) -> int:
            fd = real_open(path, flags, *args, **kw)  # type: ignore[arg-type]
            if flags & os.O_DIRECT:
                with self._lock:
                    self._fds.add(fd)
            return fd

        def preadv(fd: int, buffers: list[memoryview], offset: int, *args: object) -> int:
            if fd in self._fds:
                with self._lock:
                    self.direct.append((fd, offset))
                    count = len(self.direct)
                if refuse:
                    raise OSError(errno.EINVAL, "injected: no direct reads here")
                if fail is not None and count >= fail:
                    raise OSError(errno.EIO, "injected read failure")
            return real_preadv(fd, buffers, offset, *args)  # type: ignore[arg-type]

        def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
            self.sendfile += 1
            return real_sendfile(out_fd, in_fd, offset, count)

        monkeypatch.setattr(os, "open", opening)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "sendfile", sendfile)


def _sampler(ds: Path, ssd_dir: Path, epochs: int) -> TieredSampler:
    return TieredSampler(ds, tiers="ram,ssd", ram_size="6records", ssd_size="14records", ssd_dir=ssd_dir,
                         batch_size=4, seed=3, epochs=epochs, static_cache=0, gap_bytes=0)  # fmt: skip


@pytest.fixture
def tmpfs_slots(ssd_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``ssd_dir``, taken for a tmpfs where it is not one (the direct path is what is tested)."""
    if not on_tmpfs(ssd_dir):
        monkeypatch.setattr(ssd_direct, "on_tmpfs", lambda path: True)
    return ssd_dir


def test_on_tmpfs_agrees_with_stat(tmp_path: Path, ssd_dir: Path) -> None:
    for p in (tmp_path, ssd_dir, Path("/")):
        kind = subprocess.run(["stat", "-f", "-c", "%T", str(p)], capture_output=True, text=True, check=True)
        assert on_tmpfs(p) == (kind.stdout.strip() == "tmpfs"), p


def test_cold_records_are_read_directly_into_the_slots(tmp_path: Path, tmpfs_slots: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Records not in the page cache go to the slots by O_DIRECT reads (no sendfile), every epoch a
    permutation, each record counted once per epoch, and every batch holds the right bytes."""
    n, epochs = 41, 2
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    assert evict_page_cache(ds)
    io = _Io(monkeypatch)
    s = _sampler(ds, tmpfs_slots, epochs)
    trace: list[tuple[str, int, int]] = []
    s.stats.disk.trace = trace
    keys = np.concatenate(collect(s)).reshape(epochs, n)  # collect checks every batch's bytes
    for e in range(epochs):
        assert sorted(keys[e].tolist()) == list(range(n))
    assert io.direct and io.sendfile == 0
    assert s.stats.ssd_bytes_written == epochs * n * BIG_REC
    covered: dict[tuple[str, int], int] = defaultdict(int)
    for f, off, nb in trace:
        if nb % BIG_REC == 0 and "reservoir" not in f:
            for r in range(off // BIG_REC, (off + nb) // BIG_REC):
                covered[(f, r)] += 1
    assert len(covered) == n and set(covered.values()) == {epochs}


def test_records_in_the_page_cache_are_copied_from_it(tmp_path: Path, tmpfs_slots: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset in the page cache (just written and read) is copied by sendfile: a direct read would
    read the device again."""
    n = 41
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    with Dataset(ds) as d:
        d.payload.read(np.arange(n))
    io = _Io(monkeypatch)
    keys = np.concatenate(collect(_sampler(ds, tmpfs_slots, 1)))
    assert sorted(keys.tolist()) == list(range(n))
    assert io.sendfile and not io.direct


def test_refused_direct_reads_fall_back_to_the_copy(tmp_path: Path, tmpfs_slots: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses direct reads (EINVAL) gets the in-kernel copy, asked once."""
    n = 41
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    assert evict_page_cache(ds)
    io = _Io(monkeypatch, refuse=True)
    keys = np.concatenate(collect(_sampler(ds, tmpfs_slots, 2)))
    assert sorted(keys[:n].tolist()) == sorted(keys[n:].tolist()) == list(range(n))
    assert len(io.direct) == 1 and io.sendfile


def test_a_failed_direct_read_empties_the_slot(tmp_path: Path, tmpfs_slots: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails after others began leaves an empty slot (never one that looks written),
    and the error reaches the caller once every read in flight has ended."""
    ds = Dataset(make_dataset(tmp_path / "ds", 30, records_per_shard=4, shape=BIG))
    assert evict_page_cache(tmp_path / "ds")
    space = SsdSpace(tmpfs_slots)
    slots = ReservoirSlots(space, ds.payload, 4 * BIG_REC)
    try:
        keys = np.arange(0, 30, 2, dtype=np.int64)  # 15 runs of one record
        slots.preallocate([(0, keys.size * BIG_REC)])
        _Io(monkeypatch, fail=5)
        with pytest.raises(OSError, match="injected read failure"):
            slots.write(0, ds.payload, keys, threading.Event())
        assert os.path.getsize(slots.paths[0]) == 0
        monkeypatch.undo()
        slots.write(0, ds.payload, keys, threading.Event())  # the slot is written again in place
        np.testing.assert_array_equal(slots.records(0, keys.size, ds.payload.stats, 0).read(np.arange(keys.size)),
                                      ds.payload.read(keys))  # fmt: skip
    finally:
        slots.close()
        space.close()
        ds.close()


def test_preallocation_maps_the_slots_pages_ahead(tmp_path: Path, tmpfs_slots: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With direct reads the allocation thread also maps (and zeroes) each allocated range of the
    slot's mapping, so the device writes into ready pages; records too small or not aligned for
    direct reads keep the copy and no mapping."""
    ds = Dataset(make_dataset(tmp_path / "ds", 30, records_per_shard=4, shape=BIG))
    space = SsdSpace(tmpfs_slots)
    slots = ReservoirSlots(space, ds.payload, 4 * BIG_REC)
    done: list[tuple[int, int, int]] = []
    real = ssd_slots.populate

    def populating(m: object, offset: int, length: int) -> None:
        done.append((slots._maps.index(m), offset, length))  # type: ignore[arg-type]
        real(m, offset, length)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_slots, "populate", populating)
    monkeypatch.setattr(ssd_slots, "PREALLOCATE_CHUNK_BYTES", 4 * BIG_REC)
    try:
        slots.preallocate([(0, 6 * BIG_REC), (1, 3 * BIG_REC)])
        assert slots._allocator is not None
        slots._allocator.join(timeout=30)
        assert done == [(0, 0, 4 * BIG_REC), (0, 4 * BIG_REC, 2 * BIG_REC), (1, 0, 3 * BIG_REC)]
    finally:
        slots.close()
        space.close()
        ds.close()
    small = Dataset(make_dataset(tmp_path / "small", 8, shape=(100, 100, 3)))  # 30,000 bytes: not aligned
    try:
        assert DirectReads.suits(ds.payload, tmpfs_slots)
        assert not DirectReads.suits(small.payload, tmpfs_slots)
    finally:
        small.close()


def test_the_next_reservoir_is_read_before_the_one_before_is_passed_on(tmp_path: Path, tmpfs_slots: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill keeps the device's queue full across reservoirs: with a slot free, the direct reads
    of reservoir r + 1 are under way before reservoir r is passed on to the RAM tier (its reads
    ending, its bookkeeping, the hand-over), and every reservoir is still passed on in order. A
    reservoir's reads are submitted at once, not chunk by chunk (each chunk's end drained the queue)."""
    from shardkit.tiers.pipeline import Pipeline, ReservoirWritten

    monkeypatch.setattr(ssd_slots, "KERNEL_CHUNK_BYTES", 2 * BIG_REC)

    n = 41
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    assert evict_page_cache(ds)
    events: list[tuple[str, int]] = []
    real_submit, real_put = DirectReads.submit, Pipeline._put

    def submitting(self: DirectReads, runs: np.ndarray, *args: object) -> object:
        events.append(("submit", int(runs[:, 3].sum())))
        return real_submit(self, runs, *args)  # type: ignore[arg-type]

    def putting(self: Pipeline, q: object, item: object) -> None:
        if q is self._ssd_q and isinstance(item, ReservoirWritten):
            events.append(("put", int(item.stored.size)))
        real_put(self, q, item)  # type: ignore[arg-type]

    monkeypatch.setattr(DirectReads, "submit", submitting)
    monkeypatch.setattr(Pipeline, "_put", putting)
    keys = np.concatenate(collect(_sampler(ds, tmpfs_slots, 1)))
    assert sorted(keys.tolist()) == list(range(n))
    submitted = [size for what, size in events if what == "submit"]
    put = [size for what, size in events if what == "put"]
    assert len(put) >= 3 and submitted == put and sum(put) == n
    assert [what for what, _ in events[:3]] == ["submit", "submit", "put"]  # reservoir 1 in flight before 0 is passed on


@pytest.mark.parametrize("cold", [True, False])
def test_mapped_slots_are_read_back_from_their_mapping(tmp_path: Path, tmpfs_slots: Path,
                                                       monkeypatch: pytest.MonkeyPatch, cold: bool) -> None:  # fmt: skip
    """A slot mapped for direct reads is read back by copying from the mapping, whether the device
    (cold) or the in-kernel copy (cached) wrote it: no ``preadv`` of a slot file, every batch right,
    and the read-back counted in the SSD tier's statistics."""
    n, epochs = 41, 2
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    if cold:
        assert evict_page_cache(ds)
    else:
        with Dataset(ds) as d:
            d.payload.read(np.arange(n))
    slot_reads: list[int] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int, *args: object) -> int:
        with_name = os.readlink(f"/proc/self/fd/{fd}")
        if ssd_slots.SLOT_PREFIX in os.path.basename(with_name):
            slot_reads.append(offset)
        return real_preadv(fd, buffers, offset, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "preadv", preadv)
    s = _sampler(ds, tmpfs_slots, epochs)
    keys = np.concatenate(collect(s)).reshape(epochs, n)  # collect checks every batch's bytes
    for e in range(epochs):
        assert sorted(keys[e].tolist()) == list(range(n))
    assert slot_reads == []
    assert s.stats.ssd.bytes_read == epochs * n * BIG_REC and s.stats.ssd.records == epochs * n


def test_read_back_from_the_mapping_matches_the_file_read(tmp_path: Path) -> None:
    """The mapping's read-back puts the same bytes in the same rows as the file's read path, for a
    block's consecutive batches and for scattered rows, duplicates included."""
    n = 23
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=BIG)
    with Dataset(ds) as d:
        src = d.payload.read(np.arange(n))
        path = tmp_path / "slot"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, src.tobytes(), 0)
            m = mmap.mmap(fd, n * BIG_REC)
            rng = np.random.default_rng(1)
            keys = np.concatenate([rng.permutation(n), rng.integers(0, n, 5)])
            k = keys.size
            rows = rng.permutation(k)
            outs: list[list[np.ndarray]] = []
            for mapped in (None, m):
                rec = ssd_slots.ScratchRecords(fd, path, d.payload, n, ReadStats(), 0, mapped)
                batches = [np.zeros_like(d.payload.empty(4)) for _ in range(-(-(k + 1) // 4))]  # rows left unread match
                rec.read_into(keys, Destination(tuple(batches), *np.divmod(np.arange(k) + 1, 4), (1, 4)))
                scattered = [np.zeros_like(d.payload.empty(k)) for _ in range(2)]
                which = np.arange(k) % 2
                rec.read_into(keys, Destination(tuple(scattered), which, rows))
                outs.append(batches + scattered)
                assert rec.stats.records == 2 * k  # the mapping's copies: every record its own request
                assert rec.stats.bytes_read == 2 * (k if mapped is not None else n) * BIG_REC
            for a, b in zip(*outs):
                np.testing.assert_array_equal(a, b)
            flat = np.concatenate(outs[1][: len(outs[1]) - 2])[1 : k + 1]
            np.testing.assert_array_equal(flat, src[keys])
            del rec  # its view of the mapping
            m.close()
        finally:
            os.close(fd)


def test_direct_runs_take_each_records_offset_from_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DirectReads.runs`` asks the reader where records are (``PayloadArray.record_offsets``: its
    checked layout or its index) and joins records consecutive in a shard into one run."""
    from shardkit.formats.reader import PayloadArray

    asked: list[int] = []
    real = PayloadArray.record_offsets

    def traced(self: PayloadArray, i: int, local: np.ndarray) -> np.ndarray:
        asked.append(i)
        return real(self, i, local)

    monkeypatch.setattr(PayloadArray, "record_offsets", traced)
    with Dataset(make_dataset(tmp_path / "ds", 12, shape=BIG, records_per_shard=4)) as ds:
        keys = np.array([0, 1, 2, 5, 6, 11])
        runs = DirectReads(ds.payload).runs(keys)
        assert asked == [0, 1, 2]
        for i in range(3):
            np.testing.assert_array_equal(ds.payload.record_offsets(i, np.arange(4)), ds.payload.index(i).offsets[:4])
    assert runs is not None
    assert runs.tolist() == [[0, 0, 0, 3], [1, BIG_REC, 3, 2], [2, 3 * BIG_REC, 5, 1]]
