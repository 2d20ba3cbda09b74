"""The static (never-evicted) cache tier: same order, fewer disk bytes, pinned records read once.

The cache is part of ``ram_size`` (it used to come on top of it), so every test here gives the RAM
tier its block budget plus the cache (:func:`with_cache`), and the cache fills as the first epoch
reads its records (it used to be loaded up front).

Statistical tests use alpha = 1e-3 and fixed seeds. Checked once against a broken cache that ignores
the row map (emits each block's unpinned records first, then its pinned ones): 8 of the 11 tests fail.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ConfigError
from shardkit.formats.spec import index_nbytes
from shardkit.readers import SamplerOptions, TieredSampler, epoch_permutation
from shardkit.tiers.static_cache import pinned_keys
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import collect, epochs_of, make_dataset, opening_nbytes

REC = 16  # bytes per record of the test datasets
STACKS = {
    "ram": dict(tiers="ram", ram_size="6records"),
    "ram+ssd": dict(tiers="ram,ssd", ram_size="4records", ssd_size="10records"),
}


def with_cache(stack: str, records: int) -> dict[str, object]:
    """``STACKS[stack]`` with a static cache of ``records`` records added to its budgets."""
    kw = dict(STACKS[stack])
    kw["ram_size"] = f"{int(str(kw['ram_size']).removesuffix('records')) + records}records"
    if "ssd_size" in kw:
        kw["ssd_size"] = f"{int(str(kw['ssd_size']).removesuffix('records')) + records}records"
    return {**kw, "static_cache": f"{records}records"}


def _is_index(nb: int) -> bool:
    # A shard's index (S * 16 + 4 bytes, with the end of its records that tail_crc32c checks) is read
    # once per file per reader; with gap_bytes=0 every other request is a whole number of 16-byte records.
    return nb % REC != 0 and (nb - 4) % 16 == 0


def _data_requests(trace: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [t for t in trace if not _is_index(t[2])]


def _records_read(trace: list[tuple[str, int, int]], rps: int) -> dict[int, int]:
    """How often each record key was read, from a disk trace (shard files are named by index)."""
    count: dict[int, int] = defaultdict(int)
    for f, off, nb in _data_requests(trace):
        base = _shard_number(f) * rps
        for r in range(off // REC, (off + nb) // REC):
            count[base + r] += 1
    return count


def _shard_number(path: str) -> int:
    # Shard files live at image/c/<i>/0/0/0: the first chunk index is the shard number.
    parts = Path(path).parts
    return int(parts[parts.index("c") + 1])


def parse_static_cache(value: object, record_nbytes: int, num_records: int) -> int:
    """Records the static cache pins for ``value``, through the one options object."""
    return SamplerOptions(static_cache=value).tier_sizes(record_nbytes, num_records).static_records  # type: ignore[arg-type]


def test_parse_static_cache() -> None:
    assert parse_static_cache(0, 16, 100) == 0
    assert parse_static_cache("0", 16, 100) == 0
    assert parse_static_cache(None, 16, 100) == 0
    assert parse_static_cache(160, 16, 100) == 10
    assert parse_static_cache("7 records", 16, 100) == 7
    assert parse_static_cache("7records", 16, 100) == 7
    assert parse_static_cache("1KiB", 16, 100) == 64
    assert parse_static_cache("1GiB", 16, 100) == 100  # capped at N
    with pytest.raises(ConfigError):
        parse_static_cache("lots", 16, 100)
    with pytest.raises(ConfigError):
        parse_static_cache(-5, 16, 100)


def test_pinned_set_is_uniform() -> None:
    """P is a uniform M-subset: inclusion counts over many seeds, chi-square with N-1 dof."""
    from scipy import stats

    n, m, trials = 20, 5, 4000
    counts = np.zeros(n)
    for seed in range(trials):
        p = pinned_keys(seed, n, m)
        assert p.size == m and np.unique(p).size == m and (np.diff(p) > 0).all()
        counts[p] += 1
    assert stats.chisquare(counts).pvalue > ALPHA
    # and independent of the epoch orders: the same seed gives P regardless of epoch
    np.testing.assert_array_equal(pinned_keys(3, n, m), pinned_keys(3, n, m))


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 3)])
def test_order_identical_to_uncached(tmp_path: Path, ssd_dir: Path, stack: str, rank: int, world: int) -> None:
    ds = make_dataset(tmp_path / "ds", 41, records_per_shard=4)
    kw = dict(ssd_dir=ssd_dir, batch_size=4, epochs=3, seed=9, rank=rank, world_size=world)
    plain = collect(TieredSampler(ds, **kw, **STACKS[stack]))  # type: ignore[arg-type]
    cached_sampler = TieredSampler(ds, **kw, **with_cache(stack, 15))  # type: ignore[arg-type]
    assert cached_sampler.static_cache == 15
    assert cached_sampler.ram_block == TieredSampler(ds, **kw, **STACKS[stack]).ram_block  # type: ignore[arg-type]
    cached = collect(cached_sampler)  # collect() checks every row's payload belongs to its key
    assert [b.tolist() for b in cached] == [b.tolist() for b in plain]
    pinned = set(cached_sampler.pinned_keys.tolist())
    mine = np.concatenate(cached)
    assert cached_sampler.stats.cache.records == sum(k in pinned for k in mine.tolist())


@pytest.mark.parametrize("stack", list(STACKS))
def test_disk_bytes_per_epoch_and_pinned_read_once(tmp_path: Path, ssd_dir: Path, stack: str) -> None:
    """First epoch reads the dataset once (P for the cache, the rest for blocks); every later epoch
    reads exactly dataset bytes - pinned bytes; a pinned record is read exactly once in the run."""
    n, rps, m = 53, 4, 20
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=rps)
    s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=5, epochs=1, seed=4, gap_bytes=0,
                      **with_cache(stack, m))  # type: ignore[arg-type]
    s.stats.disk.trace = []
    per_epoch = []
    for e in range(4):  # four iterations of one epoch each: the cache persists across them
        before = len(s.stats.disk.trace)
        keys = np.concatenate(collect(s))
        np.testing.assert_array_equal(keys, epoch_permutation(4, e, n))
        new = s.stats.disk.trace[before:]
        per_epoch.append(sum(t[2] for t in _data_requests(new)))
        # the only other requests are shard indexes (each run opens its own reader)
        assert all(t[2] == opening_nbytes(min(rps, (os.path.getsize(t[0]) - index_nbytes(rps)) // REC), rps, REC)
                   and t[1] + t[2] == os.path.getsize(t[0]) for t in new if _is_index(t[2]))
    assert per_epoch == [n * REC] + [(n - m) * REC] * 3
    reads = _records_read(s.stats.disk.trace, rps)
    pinned = set(s.pinned_keys.tolist())
    assert len(pinned) == m
    assert {k: reads[k] for k in pinned} == dict.fromkeys(pinned, 1)  # never re-read
    assert {k: reads[k] for k in range(n) if k not in pinned} == {k: 4 for k in range(n) if k not in pinned}
    if stack == "ram+ssd":
        assert s.stats.ssd_bytes_written == 4 * (n - m) * REC  # pinned records never go to SSD either
    s.close()
    assert s._cache is not None and s._cache.rows is None  # close() lets go of the cache's RAM


def test_rank_slices_read_only_their_unpinned_keys(tmp_path: Path, ssd_dir: Path) -> None:
    """Four consumers share one node cache: in the first epoch each reads its own keys once (pinned
    ones into the shared rows), in the second only its unpinned keys; every consumer pins the same
    P (the whole dataset's, from the seed), and the node reads each pinned record once."""
    n, b, w, m = 40, 4, 4, 10
    ds = make_dataset(tmp_path / "ds", n)
    samplers = [TieredSampler(ds, ram_size=f"{6 + m}records", batch_size=b, rank=r, world_size=w, seed=2, epochs=1,
                              static_cache=f"{m}records", gap_bytes=0) for r in range(w)]  # fmt: skip
    pinned = set(samplers[0].pinned_keys.tolist())
    assert len(pinned) == m
    for s in samplers[1:]:
        np.testing.assert_array_equal(s.pinned_keys, samplers[0].pinned_keys)
    for e in range(2):
        before = [s.stats.disk.records for s in samplers]
        pi = epoch_permutation(2, e, n)
        for r, s in enumerate(samplers):
            mine = np.concatenate(collect(s))
            np.testing.assert_array_equal(mine, np.concatenate([pi[g * b * w + r * b : g * b * w + (r + 1) * b]
                                                                for g in range(n // (b * w) + 1)]))  # fmt: skip
            read = s.stats.disk.records - before[r]
            assert read == (mine.size if e == 0 else sum(k not in pinned for k in mine.tolist()))
    assert sum(s.stats.disk.records for s in samplers) == n + (n - m)


def test_item_position_uniform_through_cache(tmp_path: Path, ssd_dir: Path) -> None:
    """Item x position chi-square (scaled, (N-1)^2 dof) through the cached stack, both tiers."""
    n = 8
    ds = make_dataset(tmp_path / "ds", n)
    for stack, epochs in (("ram", 1200), ("ram+ssd", 300)):
        s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=3, epochs=epochs, seed=11,
                          **with_cache(stack, 3))  # type: ignore[arg-type]
        orders = epochs_of(s, n)
        assert (np.sort(orders, axis=1) == np.arange(n)).all()
        assert item_position_pvalue(orders) > ALPHA
        assert s.stats.disk.records == 3 + epochs * (n - 3)


def test_cli_static_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.cli.main import main

    ds = make_dataset(tmp_path / "ds", 25)
    out = tmp_path / "o.npy"
    try:
        main(["sample", str(ds), "--ram-size", "16records", "--batch-size", "4", "--epochs", "2",
              "--static-cache", "10records", "--order-out", str(out)])
    except SystemExit as exc:
        assert not exc.code
    text = capsys.readouterr().out
    assert "cache" in text and "(20 records)" in text  # 10 pinned, served in each of 2 epochs
    orders = np.load(out)
    np.testing.assert_array_equal(orders, np.stack([epoch_permutation(0, e, 25) for e in range(2)]))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "node-shared"])
def test_rows_are_allocated_front_to_back_off_the_readers_thread(shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """attach() starts a thread that allocates every row's bytes, front to back in chunks (the reader
    then writes allocated pages); release() stops it and waits, so nothing is allocated after the
    rows are let go; a failed allocation ends it (the reader's own reserve decides from there)."""
    import threading

    from shardkit.tiers import shm
    from shardkit.tiers import static_cache as sc

    rec, m = 4096, 40  # 160 KiB of rows, in chunks of 3 pages
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 3 * rec)
    calls: list[tuple[str, int, int]] = []
    gate, entered = threading.Event(), threading.Event()
    fail_at: list[int] = []

    def record(offset: int, length: int) -> bool:
        calls.append((threading.current_thread().name, offset, length))
        if len(calls) == 2:
            entered.set()
            assert gate.wait(timeout=30)
        return not (fail_at and offset >= fail_at[0])

    if shared:
        real_reserve = shm.SharedRegion.reserve

        def reserving(self: shm.SharedRegion, ranges: list[tuple[int, int]]) -> list[bool]:
            if threading.current_thread().name != "shardkit-cache-prefault":
                return real_reserve(self, ranges)
            ok = [record(a, n) for a, n in ranges]
            return [o and r for o, r in zip(ok, real_reserve(self, ranges))]

        monkeypatch.setattr(shm.SharedRegion, "reserve", reserving)
    else:
        real_populate = sc._populate
        monkeypatch.setattr(sc, "_populate", lambda mp, a, n: record(a, n) and real_populate(mp, a, n))

    key = f"prefault-test-{os.getpid()}-{shared}"
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=key if shared else None)
    cache.attach()
    assert entered.wait(timeout=30)  # the thread is inside its second chunk
    assert cache.rows is not None
    start = cache._layout()[0] if shared else 0
    releasing = threading.Thread(target=cache.release)
    releasing.start()
    gate.set()
    releasing.join(timeout=30)
    assert not releasing.is_alive()
    after = len(calls)
    assert after == 2 and cache._prefault is None  # stopped after the chunk it was in
    assert {name for name, _, _ in calls} == {"shardkit-cache-prefault"}
    assert [(a, n) for _, a, n in calls] == [(start, 3 * rec), (start + 3 * rec, 3 * rec)]

    # Left alone, it covers every row once, front to back; a failure ends it.
    calls.clear()
    gate.set()
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=key + "-2" if shared else None)
    cache.attach()
    assert cache._prefault is not None
    assert cache._swept.wait(timeout=30)  # the front-to-back pass is over
    spans = [(a - start, n) for _, a, n in calls]
    assert [a for a, _ in spans] == list(range(0, m * rec, 3 * rec)) and sum(n for _, n in spans) == m * rec
    cache.release()
    calls.clear()
    fail_at.append(start + 6 * rec)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=key + "-3" if shared else None)
    cache.attach()
    assert cache._prefault is not None
    assert cache._swept.wait(timeout=30)  # the front-to-back pass is over
    assert [a - start for _, a, _ in calls] == [0, 3 * rec, 6 * rec]  # nothing after the failure
    cache.release()


def test_reserve_skips_the_rows_the_prefault_thread_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's reserve() asks the region only for ranges beyond what the prefault thread has
    allocated (a second system call per range for allocated pages was a cost for nothing), and still
    for the rest: here the thread stops after its first chunk."""
    from shardkit.tiers import shm
    from shardkit.tiers import static_cache as sc

    rec, m = 4096, 40
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 8 * rec)
    asked: list[tuple[int, int]] = []
    real_reserve = shm.SharedRegion.reserve

    def reserving(self: shm.SharedRegion, ranges: list[tuple[int, int]]) -> list[bool]:
        import threading

        if threading.current_thread().name == "shardkit-cache-prefault":
            if ranges[0][0] >= cache._layout()[0] + 8 * rec:
                return [False]  # as if the node had no memory beyond the first chunk
            return real_reserve(self, ranges)
        asked.extend(ranges)
        return real_reserve(self, ranges)

    monkeypatch.setattr(shm.SharedRegion, "reserve", reserving)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=f"prefault-skip-{os.getpid()}")
    try:
        cache.attach()
        assert cache._prefault is not None
        assert cache._swept.wait(timeout=30)  # the front-to-back pass is over
        rows_at = cache._layout()[0]
        assert cache._allocated == 8 * rec  # the first chunk, then it stopped (its second call failed)
        assert cache.reserve(np.array([0, 3, 7])).all() and asked == []
        assert cache.reserve(np.array([2, 9, 30])).all()
        assert asked == [(rows_at + 9 * rec, rec), (rows_at + 30 * rec, rec)]
    finally:
        cache.release()


_HELD_FAULT = r"""
import ctypes, fcntl, mmap, os, platform, select, struct, sys, threading
from shardkit.formats import mapping
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
uffd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK) if nr else -1
if uffd < 0:
    sys.exit(77)  # no userfaultfd for this process: nothing to hold the populate with


def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


fcntl.ioctl(uffd, iowr(0x3F, 24), bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # UFFDIO_API
length = 4 * mmap.PAGESIZE
m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
view = ctypes.c_char.from_buffer(m)
addr = ctypes.addressof(view)
del view
fcntl.ioctl(uffd, iowr(0x00, 32), bytearray(struct.pack("QQQQ", addr, length, 1, 0)))  # REGISTER, missing pages
done = []
t = threading.Thread(target=lambda: done.append(mapping.populate(m, 0, length)))
t.start()
# The populate now waits in the kernel for this thread to resolve its page fault; this thread can
# only get here, and answer, if the populating thread let go of the GIL.
select.select([uffd], [], [])
os.read(uffd, 32)
fcntl.ioctl(uffd, iowr(0x04, 32), bytearray(struct.pack("QQQq", addr, length, 0, 0)))  # ZEROPAGE (and wake)
t.join()
print("answered", len(done))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_populate_lets_other_threads_run() -> None:
    """Allocating a cache's pages (a second of CPU per 753 MB) leaves the GIL to the reader, the
    assembler and the training loop: a populate held in the kernel on a page fault (userfaultfd)
    is answered by another Python thread of the process. ``mmap.madvise`` holds the GIL for the
    call: there the process deadlocks (the child is killed after the timeout)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run([sys.executable, "-c", _HELD_FAULT], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("populate held the GIL: the thread that answers its page fault never ran")
    if out.returncode == 77:
        pytest.skip("userfaultfd is not available to this process")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["answered", "1"]



def test_reserve_allocates_a_blocks_scattered_rows_in_one_system_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's cache rows lie all over the region (hundreds of ranges a block): reserve() allocates
    them in one ``process_madvise`` call, not a ctypes call per range (each gave the GIL up and
    waited to take it back: seconds of the reader's wall time per epoch). The rows are allocated
    (the region's file holds their pages afterwards), and where the kernel refuses the batched call
    it goes range by range."""
    from shardkit.formats import mapping
    from shardkit.tiers import static_cache as sc

    if mapping._process_madvise is None or not mapping._batched[0]:
        pytest.skip("no process_madvise here")
    rec, m = 3 * 4096, 600
    calls = {"batched": 0, "single": 0}
    real_pm, real_madvise = mapping._process_madvise, mapping.libc_madvise

    def batched(*args: object) -> int:
        calls["batched"] += 1
        return int(real_pm(*args))

    def single(*args: object) -> int:
        calls["single"] += 1
        return int(real_madvise(*args))

    monkeypatch.setattr(mapping, "_process_madvise", batched)
    monkeypatch.setattr(mapping, "libc_madvise", single)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=f"reserve-batch-{os.getpid()}")
    try:
        cache.attach()
        assert cache._prefault is not None
        cache._stop_prefault()  # the reader alone: every row beyond what the thread reached is its own
        cache._allocated = 0
        calls.update(batched=0, single=0)
        rows = np.arange(0, m, 2)  # 300 rows, none adjacent: 300 ranges
        assert cache.reserve(rows).all()
        assert calls == {"batched": 1, "single": 0}
        assert cache._region is not None and cache._fd is not None
        allocated = os.fstat(cache._fd).st_blocks * 512
        assert allocated >= rows.size * rec  # the pages exist (tmpfs counts them as the file's blocks)

        monkeypatch.setattr(mapping, "_batched", [False])  # a kernel without it: one call per range
        calls.update(batched=0, single=0)
        assert cache.reserve(np.arange(1, 21, 2)).all()
        assert calls == {"batched": 0, "single": 10}
    finally:
        cache.release()


def _refuse_front_to_back(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, list[tuple[int, int]]]],
                          gate: object = None) -> None:
    """Record every SharedRegion.reserve call (thread, ranges); the allocation thread's front-to-back
    chunks are refused (as if the node had no memory for them), so only announced blocks and the
    reader allocate; ``gate`` (an Event) holds the thread's first announced call until it is set."""
    import threading

    from shardkit.tiers import shm

    real = shm.SharedRegion.reserve
    held: list[bool] = []

    def reserving(self: shm.SharedRegion, ranges: list[tuple[int, int]]) -> list[bool]:
        name = threading.current_thread().name
        if name == "shardkit-cache-prefault" and len(ranges) == 1 and ranges[0][1] % 4096 == 0 and ranges[0][1] > 3 * 4096:
            return [False]  # a front-to-back chunk
        calls.append((name, list(ranges)))
        if gate is not None and name == "shardkit-cache-prefault" and not held:
            held.append(True)
            assert gate.wait(timeout=30)  # type: ignore[attr-defined]
        return real(self, ranges)

    monkeypatch.setattr(shm.SharedRegion, "reserve", reserving)


def test_announced_rows_are_allocated_by_the_cache_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """expect() hands a block's rows to the cache's allocation thread: once it has allocated them,
    the reader's reserve() of those rows allocates nothing itself (its pages exist: the region's
    file holds them) and finds every row with memory."""
    from shardkit.tiers import static_cache as sc

    rec, m = 3 * 4096, 200
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 16 * 4096)
    calls: list[tuple[str, list[tuple[int, int]]]] = []
    _refuse_front_to_back(monkeypatch, calls)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=f"ahead-{os.getpid()}")
    try:
        cache.attach()
        rows = np.arange(0, m, 3)
        job = cache.expect(rows)
        assert job is not None
        assert job.starts.size == rows.size  # one range per row: none are adjacent
        deadline = time.monotonic() + 30
        while not job.ok.all():  # the thread allocates every range of the block
            assert time.monotonic() < deadline, "the cache thread did not allocate the announced rows"
            time.sleep(0.01)
        assert cache.reserve(rows, job).all()
        assert {name for name, _ in calls} == {"shardkit-cache-prefault"}
        assert sorted(r for _, rs in calls for r in rs) == list(zip(job.starts.tolist(), (job.ends - job.starts).tolist()))
        assert cache._fd is not None and os.fstat(cache._fd).st_blocks * 512 >= rows.size * rec
    finally:
        cache.release()


def test_reader_and_cache_thread_share_an_announced_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block the thread has not finished when the reader reaches it: the reader allocates the
    ranges nobody claimed yet and waits for the one the thread is in, so every range is allocated
    once, by one of the two, before the reader writes."""
    import threading

    from shardkit.tiers import static_cache as sc

    rec, m = 3 * 4096, 400
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 16 * 4096)
    calls: list[tuple[str, list[tuple[int, int]]]] = []
    gate = threading.Event()
    _refuse_front_to_back(monkeypatch, calls, gate)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=f"ahead-share-{os.getpid()}")
    try:
        cache.attach()
        rows = np.arange(0, m, 2)  # 200 ranges: 4 claims of AHEAD_RANGES
        job = cache.expect(rows)
        assert job is not None
        deadline = time.monotonic() + 30
        while not any(name == "shardkit-cache-prefault" for name, _ in calls):  # the thread is in its first claim
            assert time.monotonic() < deadline
            time.sleep(0.01)
        releaser = threading.Timer(0.0, gate.set)
        real_run = job.run

        def reader_run(allocate: object, stop: object = None) -> None:
            real_run(allocate, stop)  # type: ignore[arg-type]
            releaser.start()  # the reader claimed all it could: now let the thread finish its claim

        job.run = reader_run  # type: ignore[method-assign]
        assert cache.reserve(rows, job).all()
        releaser.join()
        by_thread = {name: [r for n, rs in calls if n == name for r in rs] for name, _ in calls}
        assert len(by_thread["shardkit-cache-prefault"]) == sc.AHEAD_RANGES
        assert len(by_thread["MainThread"]) == rows.size - sc.AHEAD_RANGES
        assert sorted(r for rs in by_thread.values() for r in rs) == list(zip(job.starts.tolist(), (job.ends - job.starts).tolist()))
    finally:
        gate.set()
        cache.release()


def test_the_reader_announces_each_next_blocks_cache_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a node-shared cache that holds every record, the reader announces each block's rows to
    the cache while it reads the block before (expect), and reserves every block but the run's
    first with what it announced: the rows of that block, nothing else. The order is unchanged.
    (What the thread does with an announcement: the two tests above.) The dataset's files are
    taken as unmappable (remote or compressed), so the cache keeps its own rows."""
    from shardkit.order import schedule
    from shardkit.tiers import static_cache as sc
    from shardkit.tiers.mapped import MappedShards

    monkeypatch.setattr(MappedShards, "open", classmethod(lambda cls, payload: None))

    n, rec = 300, 64 * 64
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 20 * rec)  # blocks of 20, then 60 records
    monkeypatch.setattr(schedule, "MIN_BLOCK_BYTES", 60 * rec)
    path = make_dataset(tmp_path / "ds", n, records_per_shard=7, shape=(64, 64, 1))
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 16 * 4096)
    _refuse_front_to_back(monkeypatch, [])  # the thread allocates announced blocks only
    announced: list[tuple[np.ndarray, object]] = []
    reserved: list[tuple[np.ndarray, object]] = []
    real_expect, real_reserve = sc.StaticCache.expect, sc.StaticCache.reserve

    def expect(self: sc.StaticCache, rows: np.ndarray) -> sc.Ahead | None:
        job = real_expect(self, rows)
        announced.append((np.sort(rows), job))
        return job

    def reserve(self: sc.StaticCache, rows: np.ndarray, ahead: sc.Ahead | None = None) -> np.ndarray:
        reserved.append((np.sort(rows), ahead))
        return real_reserve(self, rows, ahead)

    monkeypatch.setattr(sc.StaticCache, "expect", expect)
    monkeypatch.setattr(sc.StaticCache, "reserve", reserve)
    kw = dict(batch_size=10, epochs=2, seed=3, ram_size=f"{3 * n}records", node_sharing=True)
    s = TieredSampler(path, **kw)  # type: ignore[arg-type]
    try:
        if not (s.static_cache == n and s._cache is not None and s._cache.share_key is not None):
            pytest.skip("node sharing is not available here")
        got = epochs_of(s, n)
    finally:
        s.close()
    plain = TieredSampler(path, **{**kw, "static_cache": 0})  # type: ignore[arg-type]
    try:
        np.testing.assert_array_equal(got, epochs_of(plain, n))
    finally:
        plain.close()
    assert s.block_schedule[0] < s.block_schedule[1] < n
    assert len(reserved) >= 3  # epoch 1 only: epoch 2 finds every row filled
    assert reserved[0][1] is None  # the first block: nothing was announced before it
    assert len(announced) == len(reserved) - 1
    for (rows, ahead), (expected, job) in zip(reserved[1:], announced):
        assert isinstance(ahead, sc.Ahead) and ahead is job
        np.testing.assert_array_equal(rows, expected)
    assert sum(r.size for r, _ in reserved) == n


def test_the_front_to_back_pass_stops_once_blocks_are_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that announces its blocks gets every block's rows allocated in its own order, so
    the front-to-back pass stops at the first announcement: it would populate those pages a second
    time (a page walk each: +0.3 CPU s per GB on a cold first epoch)."""
    import threading

    from shardkit.tiers import shm
    from shardkit.tiers import static_cache as sc

    rec, m = 4096, 64
    monkeypatch.setattr(sc, "PREFAULT_CHUNK_BYTES", 8 * rec)
    chunks: list[int] = []
    gate, entered = threading.Event(), threading.Event()
    real = shm.SharedRegion.reserve

    def reserving(self: shm.SharedRegion, ranges: list[tuple[int, int]]) -> list[bool]:
        if threading.current_thread().name == "shardkit-cache-prefault" and len(ranges) == 1 and ranges[0][1] == 8 * rec:
            chunks.append(ranges[0][0])
            entered.set()
            assert gate.wait(timeout=30)
        return real(self, ranges)

    monkeypatch.setattr(shm.SharedRegion, "reserve", reserving)
    cache = sc.StaticCache(5, 2 * m, m, (rec,), np.dtype(np.uint8), share_key=f"ahead-stop-{os.getpid()}")
    try:
        cache.attach()
        assert entered.wait(timeout=30)  # the pass is in its first chunk
        job = cache.expect(np.arange(40, m, 2))
        assert job is not None
        gate.set()
        assert cache._swept.wait(timeout=30)
        assert cache.reserve(np.arange(40, m, 2), job).all()
        assert len(chunks) == 1  # the chunk it was in, then no more
    finally:
        gate.set()
        cache.release()
