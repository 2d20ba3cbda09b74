"""Shards streamed into the cache in parts (issue 32, items 1 and 3): a cold epoch equals a local
run and fetches each byte once; a block's records are served from partial copies before any shard
is complete; a second process reads a copy another one fills without fetching anything; a waiter
takes over the copy of a filler that died; failed parts are fetched again, never delivered."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats import Dataset
from shardkit.formats.reader import ReadStats
from shardkit.formats.spec import index_nbytes
from shardkit.readers import TieredSampler
from shardkit.stores import cache as cache_mod
from shardkit.stores import open_store, prefetch
from tests.helpers.datasets import upload
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.forks import wait_child
from tests.helpers.sampler_data import check_batch, make_dataset
from tests.helpers.small_parts import cache_dir as _cache

N, PER_SHARD, SHAPE = 120, 40, (64, 64, 4)  # 16 KiB records: shards of 10 pages
SHARDS = N // PER_SHARD
ONE_PER_SHARD = [3, PER_SHARD + 17, 2 * PER_SHARD + 30]


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of two pages, so these small shards are downloaded in five parts each."""
    monkeypatch.setattr(prefetch, "PART_BYTES", 2 * cache_mod.PAGE_BYTES)


@pytest.fixture
def dataset(s3: Any, tmp_path: Path, small_parts: None) -> tuple[Path, str]:
    local = make_dataset(tmp_path / "ds", N, records_per_shard=PER_SHARD, shape=SHAPE)
    return local, upload(local, s3.url(f"stream-{tmp_path.name}"))


@pytest.fixture
def proxy(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    yield p
    p.close()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds back the background order of this process's downloads until set."""
    hold = threading.Event()
    monkeypatch.setattr(prefetch, "hold_background", hold)
    yield hold
    hold.set()


def _final_copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("shard-*") if p.is_file() and not p.name.endswith(".part"))


def _shard_bytes(local: Path) -> list[bytes]:
    return [(local / "image" / "c" / str(i) / "0" / "0" / "0").read_bytes() for i in range(SHARDS)]


def _wait_all(ds: Dataset) -> None:
    pf = ds.payload.prefetcher  # type: ignore[attr-defined]
    assert pf is not None
    for i in range(len(pf.items)):
        pf.wait(i)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_streamed_epoch_matches_local_and_fetches_each_byte_once(dataset: tuple[Path, str], proxy: FaultProxy,
                                                                  tmp_path: Path) -> None:
    local, url = dataset
    kw: dict[str, Any] = {"batch_size": 8, "epochs": 1, "seed": 5, "ram_size": "30records"}
    expected = list(TieredSampler(str(local), **kw))
    s = TieredSampler(url, cache_dir=_cache(tmp_path), **kw)
    got = list(s)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        check_batch(a)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    total = sum(len(b) for b in _shard_bytes(local))
    assert s.stats.disk.bytes_read == total  # every byte of every shard once, nothing twice
    parts = [path for path, ranged in proxy.gets if ranged and "/image/c/" in path]
    assert len(parts) >= 2 * SHARDS  # downloaded in ranged parts, not whole
    assert [p.read_bytes() for p in _final_copies(_cache(tmp_path))] == _shard_bytes(local)


def test_first_block_is_served_before_any_shard_completes(dataset: tuple[Path, str], held: threading.Event,
                                                          tmp_path: Path) -> None:
    """With the background order held back, a read of one record per shard is served from the
    partial copies (their pages asked for first, merged across small gaps): no shard is complete,
    a fraction of the bytes came."""
    local, url = dataset
    cache = _cache(tmp_path)
    stats = ReadStats()
    with Dataset(url, cache_dir=cache, stats=stats) as ds:
        t, out = _in_thread(lambda: ds.read(ONE_PER_SHARD))
        t.join(60)
        assert out and not isinstance(out[0], BaseException), out
        check_batch({"key": np.array(ONE_PER_SHARD), **out[0]})
        assert not _final_copies(cache)
        total = sum(len(b) for b in _shard_bytes(local))
        # the records' and tails' pages, and the gaps of up to demand_gap_pages between them
        assert 0 < stats.bytes_read <= total // 2
        held.set()
        _wait_all(ds)
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)
    assert stats.bytes_read == total


def test_a_stopped_fill_is_resumed_not_fetched_again(dataset: tuple[Path, str], held: threading.Event,
                                                     tmp_path: Path) -> None:
    """A reader closed while its copies are partial leaves them with their maps; the next reader
    resumes them and fetches only the pages that were missing."""
    local, url = dataset
    cache = _cache(tmp_path)
    first, second = ReadStats(), ReadStats()
    with Dataset(url, cache_dir=cache, stats=first) as ds:
        ds.read(ONE_PER_SHARD)
    assert not _final_copies(cache) and len(list(cache.rglob("shard-*.part"))) == SHARDS
    held.set()
    with Dataset(url, cache_dir=cache, stats=second) as ds:
        batch = ds.read(list(range(N)))
        check_batch({"key": np.arange(N), **batch})
        _wait_all(ds)
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)
    assert first.bytes_read > 0
    assert first.bytes_read + second.bytes_read == sum(len(b) for b in _shard_bytes(local))


_SECOND = """
import sys, numpy as np
from shardkit.readers import TieredSampler
from tests.helpers.sampler_data import check_batch
s = TieredSampler(sys.argv[1], batch_size=8, epochs=1, seed=9, ram_size="30records", cache_dir=sys.argv[2])
keys = np.concatenate([check_batch(b) for b in s])
print(keys.size, s.stats.disk.bytes_read, s.stats.disk.read_calls, s.stats.remote_cache.bytes_read)
"""


def _env(proxy: FaultProxy | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    if proxy is not None:
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
    return env


def test_second_process_reads_the_fill_of_the_first(dataset: tuple[Path, str], held: threading.Event,
                                                    tmp_path: Path) -> None:
    """This process claims every shard's copy and holds its background order back; another process
    then runs a whole epoch on the same cache: every page it needs is fetched once, by this
    process, at its request, and it fetches nothing itself."""
    local, url = dataset
    cache = _cache(tmp_path)
    stats = ReadStats()
    with Dataset(url, cache_dir=cache, stats=stats) as ds:
        ds.read(ONE_PER_SHARD)  # claims all three copies
        assert not _final_copies(cache)
        out = subprocess.run([sys.executable, "-c", _SECOND, url, str(cache)], env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        count, fetched, requests, local_bytes = map(int, out.stdout.split())
        assert count == N and fetched == 0 and requests == 0 and local_bytes > 0
        held.set()
        _wait_all(ds)
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)
    assert stats.bytes_read == sum(len(b) for b in _shard_bytes(local))  # each byte once on the node


def test_a_filler_fetches_pages_another_process_asks_for_at_once(dataset: tuple[Path, str], held: threading.Event,
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages another process asks for through a copy's map are noticed when it asks (the cache's ask
    counter), not on a timer or when a fetch thread happens to be idle: with every timer here
    set to ten minutes, a second process still reads a whole epoch from the copies this one fills."""
    monkeypatch.setattr(prefetch, "_WANTED_POLL_SECONDS", 600.0)
    monkeypatch.setattr(prefetch, "_IDLE_SECONDS", 600.0)
    _, url = dataset
    cache = _cache(tmp_path)
    with Dataset(url, cache_dir=cache) as ds:
        ds.read(ONE_PER_SHARD)  # claims all three copies; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        before = pf.stats.parts_demanded
        out = subprocess.run([sys.executable, "-c", _SECOND, url, str(cache)], env=_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        count, fetched, requests, _ = map(int, out.stdout.split())
        assert count == N and fetched == 0 and requests == 0
        assert pf.stats.parts_demanded > before  # fetched here, at its request
        held.set()


def test_another_processs_earlier_ask_is_served_before_a_later_block_here(
        dataset: tuple[Path, str], held: threading.Event, tmp_path: Path) -> None:
    """Pages another process asked for join the queue of asked-for pages when the filler notices
    them, behind what was asked before and ahead of what this process asks later (a worker's next
    block, which asks for whole parts, no longer overtakes its sibling's first block)."""
    _, url = dataset
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read(ONE_PER_SHARD)  # claims all three copies; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        copy = pf.copy(1)
        assert copy is not None and copy.owned
        try:
            with pf._cond:  # no fetch thread picks meanwhile
                assert not pf._demand
                cache_mod.ShardCache.want(copy.map_fd, copy.size, 0, 1)  # as another process asks
                pf.cache.ask()
                pf._look_at_maps()  # what the watcher does when the ask counter changes
                pf._demanded(1, [(2, 3)])  # a later block of this process
                queued = [(i, lo, hi) for *_, i, lo, hi in sorted(pf._demand)]  # in serving order
        finally:
            copy.close()
        assert queued == [(1, 0, 1), (1, 2, 3)]
        held.set()


def test_the_first_batchs_asks_are_served_before_a_siblings_first_block(
        dataset: tuple[Path, str], held: threading.Event, tmp_path: Path) -> None:
    """Asked-for pages are served by priority, then first asked first served: another process's
    first block at priority 0 (DataLoader worker 0, whose batch the main process takes first) goes
    before this process's first block asked sooner at priority 1, and both before any later block."""
    _, url = dataset
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read(ONE_PER_SHARD)  # claims all three copies; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        copy = pf.copy(1)
        assert copy is not None and copy.owned
        try:
            with pf._cond:  # no fetch thread picks meanwhile
                assert not pf._demand
                cache_mod.ShardCache.want(copy.map_fd, copy.size, 3, 4, cache_mod.LAST_PRIORITY)  # a later block there
                pf.cache.ask()
                pf._look_at_maps()
                pf._demanded(1, [(2, 3)], 1)  # this process's first block (worker 1)
                cache_mod.ShardCache.want(copy.map_fd, copy.size, 0, 1, 0)  # worker 0's first block, asked last
                pf.cache.ask()
                pf._look_at_maps()
                pf._demanded(1, [(1, 2)], cache_mod.LAST_PRIORITY)  # a later block here
                queued = [(i, lo, hi) for *_, i, lo, hi in sorted(pf._demand)]  # in serving order
        finally:
            copy.close()
        assert queued == [(1, 0, 1), (1, 2, 3), (1, 3, 4), (1, 1, 2)]
        held.set()


def test_a_readers_first_block_asks_at_its_priority_and_later_blocks_last(
        dataset: tuple[Path, str], held: threading.Event, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's first block asks a copy's filler at the reader's ``ask_priority``, every later
    block at ``LAST_PRIORITY`` (after every consumer's first block)."""
    _, url = dataset
    priorities: list[int] = []
    real_request = prefetch.PartialCopy.request

    def request(self: prefetch.PartialCopy, spans: list[tuple[int, int]], priority: int = 0) -> None:
        priorities.append(priority)
        real_request(self, spans, priority)

    monkeypatch.setattr(prefetch.PartialCopy, "request", request)
    with Dataset(url, cache_dir=_cache(tmp_path), ask_priority=3) as ds:
        check_batch({"key": np.array([3]), **ds.read([3])})
        first = len(priorities)
        check_batch({"key": np.array([PER_SHARD + 5]), **ds.read([PER_SHARD + 5])})  # (the background is held)
        held.set()
    assert first and priorities[:first] == [3] * first
    assert priorities[first:] and set(priorities[first:]) == {cache_mod.LAST_PRIORITY}


def test_fillers_share_the_background_parts(dataset: tuple[Path, str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes that fill one cache together (a DataLoader's workers) each keep their share of
    ``MAX_PARTS_IN_FLIGHT`` streaming: together they put on the link what one process would, and a
    worker's first block does not wait behind every worker's full width of background parts."""
    _, url = dataset
    streaming: list[int] = []
    real = prefetch.parts_in_flight

    def width(n: int, rate: float, latency: float, part_bytes: int, most: int) -> int:
        streaming.append(n)
        return real(n, rate, latency, part_bytes, most)

    monkeypatch.setattr(prefetch, "parts_in_flight", width)
    for fillers, share in ((1, prefetch.MAX_PARTS_IN_FLIGHT), (4, prefetch.MAX_PARTS_IN_FLIGHT // 4)):
        streaming.clear()
        (tmp_path / str(fillers)).mkdir()
        with Dataset(url, cache_dir=_cache(tmp_path / str(fillers)), fillers=fillers) as ds:
            check_batch({"key": np.array([3]), **ds.read([3])})
            pf = ds.payload.prefetcher  # type: ignore[attr-defined]
            assert pf._streaming == share
            _wait_all(ds)
        assert streaming and set(streaming) == {share}


_FILLER = """
import sys, threading
import shardkit.stores.prefetch as prefetch
from shardkit.formats import Dataset
prefetch.hold_background = threading.Event()  # claims, serves nothing but its own read, never finishes
prefetch.PART_BYTES = 2 * 65536  # the parts of the test's process (and so its gaps between asked-for pages)
ds = Dataset(sys.argv[1], cache_dir=sys.argv[2])
ds.read([int(k) for k in sys.argv[3:]])
ds.payload.prefetcher._cond.acquire()  # a hung filler: its workers serve no other process's request
print("ready", flush=True)
sys.stdin.read()
"""


def _asked(map_file: Path) -> bool:
    """Some page of the copy was asked for by a waiting process (the second half of its map)."""
    raw = map_file.read_bytes()
    return any(raw[len(raw) // 2 :])


def test_waiter_takes_over_from_a_dead_filler(dataset: tuple[Path, str], tmp_path: Path) -> None:
    """Another process claimed the copies and dies (SIGKILL) while this one waits on them: the
    waiter sees the filler's lock gone, takes the copies over (resuming their pages) and reads the
    right records."""
    local, url = dataset
    cache = _cache(tmp_path)
    filler = subprocess.Popen([sys.executable, "-c", _FILLER, url, str(cache), *map(str, ONE_PER_SHARD)], env=_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert filler.stdout is not None and filler.stdout.readline().strip() == "ready", filler.stderr
        maps = sorted(cache.rglob("map-shard-*"))
        assert len(maps) == SHARDS
        keys = [20, PER_SHARD + 1, 2 * PER_SHARD + 10]  # on pages the filler did not fetch (nor between its asks)
        with Dataset(url, cache_dir=cache) as ds:
            t, out = _in_thread(lambda: ds.read(keys))
            # The waiter asks the (silent) filler for its pages through the maps: then it is waiting.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(_asked(m) for m in maps):
                time.sleep(0.01)
            assert all(_asked(m) for m in maps)
            assert t.is_alive()
            filler.send_signal(signal.SIGKILL)
            filler.wait(30)
            t.join(60)
            assert out and not isinstance(out[0], BaseException), out
            check_batch({"key": np.array(keys), **out[0]})
            _wait_all(ds)
    finally:
        if filler.poll() is None:
            filler.kill()
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


def test_waiter_replaces_a_hung_filler(dataset: tuple[Path, str], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A filler that holds its copies but writes nothing for STALE_SECONDS (here shortened) is
    replaced by the process waiting on it, which downloads the copies itself."""
    local, url = dataset
    cache = _cache(tmp_path)
    monkeypatch.setattr(cache_mod, "STALE_SECONDS", 1.0)
    monkeypatch.setattr(prefetch, "STALE_SECONDS", 1.0)
    filler = subprocess.Popen([sys.executable, "-c", _FILLER, url, str(cache), *map(str, ONE_PER_SHARD)], env=_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert filler.stdout is not None and filler.stdout.readline().strip() == "ready", filler.stderr
        keys = [20, PER_SHARD + 1, 2 * PER_SHARD + 10]  # as above
        with Dataset(url, cache_dir=cache) as ds:
            t, out = _in_thread(lambda: ds.read(keys))
            t.join(120)
            assert out and not isinstance(out[0], BaseException), out
            check_batch({"key": np.array(keys), **out[0]})
            _wait_all(ds)
        assert filler.poll() is None  # still alive (hung), its copies replaced
    finally:
        filler.kill()
        filler.wait(30)
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


@pytest.mark.parametrize("fault", ["short", "lie", "reset", "503"])
def test_failed_parts_are_fetched_again_not_delivered(dataset: tuple[Path, str], s3: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Every other ranged GET (the parts) fails; the epoch still equals the local one and the copies
    are the exact shards."""
    local, url = dataset
    proxy = FaultProxy(s3.port, lambda n: fault if n % 2 == 0 else "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        kw: dict[str, Any] = {"batch_size": 8, "epochs": 1, "seed": 2, "ram_size": "30records"}
        expected = list(TieredSampler(str(local), **kw))
        got = list(TieredSampler(url, cache_dir=_cache(tmp_path), **kw))
        # the epoch may end while a part no block waits for is still being retried: the sampler's close
        # stops it and keeps that copy, which the next reader finishes
        with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
            ds.read(ONE_PER_SHARD)
            if ds.payload.prefetcher is not None:  # type: ignore[attr-defined]
                _wait_all(ds)
    finally:
        proxy.close()
    assert proxy.done[fault] >= SHARDS
    for a, b in zip(got, expected, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert [p.read_bytes() for p in _final_copies(_cache(tmp_path))] == _shard_bytes(local)


def test_a_fill_closed_mid_part_is_kept_for_the_next_filler(dataset: tuple[Path, str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that closes while a part streams (its sink stops it) keeps that copy with its map,
    as it keeps copies with nothing in flight: the next filler fetches only the cut part's pages."""
    local, url = dataset
    cache = _cache(tmp_path)
    cut_start = 2 * cache_mod.PAGE_BYTES  # shard 0's second part
    reached = threading.Event()
    real = prefetch._PartSink.__call__

    def held_until_closing(self: Any, pos: int, chunk: memoryview) -> None:
        if self.fill.index == 0 and self.start == cut_start:
            reached.set()
            deadline = time.monotonic() + 60
            while not self.closing() and time.monotonic() < deadline:
                time.sleep(0.01)
        real(self, pos, chunk)

    monkeypatch.setattr(prefetch._PartSink, "__call__", held_until_closing)
    total = sum(len(b) for b in _shard_bytes(local))
    ds = Dataset(url, cache_dir=cache)
    try:
        check_batch({"key": np.array([0]), **ds.read([0])})  # (not in the held part) starts the background
        assert reached.wait(60)
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        while pf.stats.bytes < total - 2 * cache_mod.PAGE_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)  # every other part landed
        assert pf.stats.bytes == total - 2 * cache_mod.PAGE_BYTES
    finally:
        ds.close()  # the held part's next chunk sees the prefetcher closing
    assert len(_final_copies(cache)) == SHARDS - 1
    monkeypatch.setattr(prefetch._PartSink, "__call__", real)
    with Dataset(url, cache_dir=cache) as ds:
        check_batch({"key": np.array([0]), **ds.read([0])})
        _wait_all(ds)
        assert ds.payload.prefetcher.stats.bytes == 2 * cache_mod.PAGE_BYTES  # type: ignore[attr-defined]
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


@pytest.mark.parametrize("per", [prefetch.PART_BYTES // cache_mod.PAGE_BYTES, 8])
def test_later_blocks_ask_for_whole_parts(per: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first block, asked-for pages widen to the background's parts (clipped to the copy,
    neighbours merged), so the epoch is fetched in part-sized requests; the parts' size is read when
    called (tests shrink it)."""
    from shardkit.formats.ranged import _whole_parts

    monkeypatch.setattr(prefetch, "PART_BYTES", per * cache_mod.PAGE_BYTES)
    assert _whole_parts([(3, 5)], 10 * per) == [(0, per)]
    assert _whole_parts([(3, 5), (per + 1, per + 2), (5 * per, 5 * per + 1)], 10 * per) == [(0, 2 * per), (5 * per, 6 * per)]
    assert _whole_parts([(9 * per + 1, 9 * per + 3)], 9 * per + 2) == [(8 * per, 9 * per + 2)]  # a short rest joins the last part
    assert _whole_parts([(9 * per + 1, 9 * per + 3)], 9 * per + per // 2) == [(9 * per, 9 * per + per // 2)]  # a long one is a part


def test_copies_are_checked_from_their_parts_not_read_again(dataset: tuple[Path, str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part is checksummed while it is in memory; a complete copy's crc32c (and its records')
    is those combined, so no copy is read back before it gets its final name."""
    from shardkit.formats import ranged

    local, url = dataset
    cache = _cache(tmp_path)
    reads_back: list[int] = []
    real = ranged.fd_crc32c

    def counted(fd: int, data_nbytes: int, chunk: int = 8 << 20) -> tuple[int, int, int]:
        reads_back.append(fd)
        return real(fd, data_nbytes, chunk)

    monkeypatch.setattr(ranged, "fd_crc32c", counted)
    with Dataset(url, cache_dir=cache) as ds:
        assert all(s.data_crc32c is not None for s in ds.payload.shards)  # both checksums are checked
        batch = ds.read(list(range(N)))
        check_batch({"key": np.arange(N), **batch})
        _wait_all(ds)
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        assert pf.stats.reread_bytes == 0
        assert pf.stats.bytes == sum(len(b) for b in _shard_bytes(local))
    assert reads_back == []
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


@pytest.mark.parametrize("where", ["first", "middle", "last record byte", "index"])
def test_a_corrupt_part_never_becomes_a_copy(s3: Any, tmp_path: Path, small_parts: None, where: str) -> None:
    """A byte that differs from the recorded checksums, in any part (on either side of where the
    records' checksum ends), fails the combined check: the copy is refused, never named."""
    local = make_dataset(tmp_path / "ds", N, records_per_shard=PER_SHARD, shape=SHAPE)
    url = upload(local, s3.url(f"corrupt-{tmp_path.name}"))
    store = open_store(url)
    key = "image/c/1/0/0/0"
    raw = bytearray(store.get(key))
    data_nbytes = len(raw) - index_nbytes(PER_SHARD)  # the records' bytes, then the index
    at = {"first": 0, "middle": data_nbytes // 2, "last record byte": data_nbytes - 1, "index": data_nbytes + 1}[where]
    raw[at] ^= 0xFF
    store.put(key, bytes(raw))
    cache = _cache(tmp_path)
    with Dataset(url, cache_dir=cache) as ds, pytest.raises(CorruptShardError, match=r"image/c/1/0/0/0.*crc32c"):
        ds.read([0])  # shard 0 only: shard 1 is filled by the background, in parts
        _wait_all(ds)
    assert not any(p.name.startswith("shard-00000001") for p in cache.rglob("*"))


def test_no_background_part_starts_while_asked_for_parts_are_in_flight(
        dataset: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No background part starts while asked-for parts are in flight: a block's records do not share
    the link with parts nobody waits for yet. (Every fetch is held until the reader has asked.)"""
    local, url = dataset
    asked = threading.Event()
    real_demanded, real_fetch = prefetch.ShardPrefetcher._demanded, prefetch.ShardPrefetcher._fetch

    def demanded(self: prefetch.ShardPrefetcher, i: int, spans: list[tuple[int, int]], priority: int = 0) -> None:
        real_demanded(self, i, spans, priority)
        asked.set()

    def fetch(self: prefetch.ShardPrefetcher, fill: Any, lo: int, hi: int) -> None:
        assert asked.wait(60)
        real_fetch(self, fill, lo, hi)

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_demanded", demanded)
    monkeypatch.setattr(prefetch.ShardPrefetcher, "_fetch", fetch)
    cache = _cache(tmp_path)
    with Dataset(url, cache_dir=cache) as ds:
        check_batch({"key": np.array(ONE_PER_SHARD), **ds.read(ONE_PER_SHARD)})
        _wait_all(ds)
        timeline = list(ds.payload.prefetcher.stats.in_flight)  # type: ignore[attr-defined]
    assert any(demand for _, demand, _ in timeline)  # the block's pages were asked for
    for (_, _, bg_before), (_, demand, bg) in itertools.pairwise(timeline):
        assert not (bg > bg_before and demand), timeline  # a background part started while asked-for ones ran
    assert any(bg for _, _, bg in timeline)  # the background did run afterwards
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


def test_runs_are_read_as_their_pages_land_not_in_shard_order(dataset: tuple[Path, str], held: threading.Event,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's run of a later shard whose pages are local is read while the pages of an earlier
    shard are still on their way (every fetch for shard 0 is held until a later shard's run was read)."""
    from shardkit.formats import ranged

    local, url = dataset
    later_read = threading.Event()
    order: list[int] = []
    real_fetch, real_read = prefetch.ShardPrefetcher._fetch, ranged.RangedPayloadArray._read_cached

    def fetch(self: prefetch.ShardPrefetcher, fill: Any, lo: int, hi: int) -> None:
        if fill.index == 0:
            later_read.wait(15)  # without reading in landing order the reader waits for shard 0 first
        real_fetch(self, fill, lo, hi)

    def read_cached(self: Any, fd: int, run: Any, rows: Any) -> None:
        order.append(run.shard)
        real_read(self, fd, run, rows)
        if {1, 2} <= set(order):  # both later shards read: only now may shard 0 land (released after
            later_read.set()  # shard 1 alone, it may land before shard 2's pages and rightly be read second)

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_fetch", fetch)
    monkeypatch.setattr(ranged.RangedPayloadArray, "_read_cached", read_cached)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        check_batch({"key": np.array(ONE_PER_SHARD), **ds.read(ONE_PER_SHARD)})
        held.set()
        _wait_all(ds)
    assert order[:3] != [0, 1, 2] and order[-1] == 0, order
    assert sorted(order) == [0, 1, 2]
    assert [p.read_bytes() for p in _final_copies(_cache(tmp_path))] == _shard_bytes(local)


@pytest.mark.parametrize("gap_bytes", [0, 64 << 10])
def test_cached_records_are_read_straight_into_their_rows(dataset: tuple[Path, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, gap_bytes: int) -> None:
    """Records of a local copy are read by ``preadv`` straight into the destination's rows (gaps
    between them, when a run reads some, into scratch): no temporary to fill and copy again."""
    _, url = dataset
    rec = int(np.prod(SHAPE))
    keys = np.array([5, 1, 2, 3, 39, 44, 46, 47, 80, 119, 0, 100, 101])
    out = np.zeros((keys.size, *SHAPE), dtype=np.uint8)
    rows = {out.ctypes.data + j * rec for j in range(keys.size)}
    into: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int, *flags: int) -> int:
        into.extend((np.frombuffer(b, dtype=np.uint8).ctypes.data, memoryview(b).nbytes) for b in buffers)
        return real(fd, buffers, offset, *flags)

    with Dataset(url, cache_dir=_cache(tmp_path), remote_gap_bytes=gap_bytes) as ds:
        ds.read([0])  # starts the download
        _wait_all(ds)  # every copy complete: the read below is served from them alone
        monkeypatch.setattr(os, "preadv", preadv)
        batch = ds.read(keys, out)
        monkeypatch.undo()
    check_batch(batch)
    assert batch["image"] is out
    lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
    inside = [(addr, n) for addr, n in into if lo <= addr < hi]
    assert all(n % rec == 0 for _, n in inside)  # records adjacent in the copy and in the rows share an iovec
    pieces = [addr + k * rec for addr, n in inside for k in range(n // rec)]
    assert sorted(pieces) == sorted(rows)  # each record read once, into its row
    outside = [n for addr, n in into if not lo <= addr < hi]
    assert not outside if not gap_bytes else 0 < sum(outside) <= gap_bytes * keys.size  # gaps only, into scratch


def test_reading_a_copy_continues_short_reads_and_refuses_a_short_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``preadv`` that returns fewer bytes than asked is continued where it stopped (into the right
    buffers); a copy that ends before the asked span is TruncatedShardError naming it."""
    from shardkit.errors import TruncatedShardError
    from shardkit.formats.reader import preadv_exact

    path = tmp_path / "copy"
    path.write_bytes(bytes(range(256)) * 4)
    real = os.preadv

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        return real(fd, [memoryview(buffers[0])[:3]], offset)  # at most 3 bytes a call

    monkeypatch.setattr(os, "preadv", short)
    bufs = [bytearray(5), bytearray(0), bytearray(7)]
    fd = os.open(path, os.O_RDONLY)
    try:
        preadv_exact(fd, [memoryview(b) for b in bufs], 10, "the copy")
        assert bytes(bufs[0] + bufs[2]) == bytes(range(10, 22))
        with pytest.raises(TruncatedShardError, match="the copy: expected 8 bytes at 1020"):
            preadv_exact(fd, [memoryview(bytearray(8))], 1020, "the copy")
    finally:
        os.close(fd)


def test_asking_for_pages_wakes_the_threads_it_needs_not_all(dataset: tuple[Path, str], held: threading.Event,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's request for pages wakes as many idle fetch threads as it makes parts (a reader asks
    once per copy, not once per run), not every thread: each woken thread scans the fills under
    the prefetcher's lock. (Idle threads otherwise sleep; the background is held.)"""
    monkeypatch.setattr(prefetch, "_IDLE_SECONDS", 600.0)
    monkeypatch.setattr(prefetch, "_WANTED_POLL_SECONDS", 600.0)
    picks: list[tuple[str, bool]] = []
    seen: set[str] = set()
    all_looked = threading.Event()  # every thread made its first pick (they start idle after it)
    real_pick = prefetch.ShardPrefetcher._pick

    def pick(self: prefetch.ShardPrefetcher) -> Any:
        got = real_pick(self)
        name = threading.current_thread().name
        picks.append((name, got is not None))
        seen.add(name)
        if len(seen) == len(self._threads):
            all_looked.set()
        return got

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_pick", pick)
    asks: list[int] = []
    real_demanded = prefetch.ShardPrefetcher._demanded

    def demanded(self: prefetch.ShardPrefetcher, i: int, spans: list[tuple[int, int]], priority: int = 0) -> None:
        asks.append(i)
        real_demanded(self, i, spans, priority)

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_demanded", demanded)
    keys = [PER_SHARD + 1, PER_SHARD + 9, PER_SHARD + 17, PER_SHARD + 25, PER_SHARD + 33]  # five runs in one shard
    with Dataset(dataset[1], cache_dir=_cache(tmp_path)) as ds:
        check_batch({"key": np.array([3]), **ds.read([3])})  # starts the prefetcher; every thread looks once
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        threads = len(pf._threads)
        assert all_looked.wait(60)
        _until_still(picks)  # the threads woken by the first read have looked
        picks.clear()
        asks.clear()
        check_batch({"key": np.array(keys), **ds.read(keys)})
        _until_still(picks)
        woken = list(picks)
    assert threads >= 16
    assert asks == [1]  # the five runs' pages in one request to the copy
    parts = sum(got for _, got in woken)
    idle = sum(not got for _, got in woken)
    # Woken for nothing: at most one thread per part asked for and one as each part lands; none for
    # the background, which is held here; not every thread.
    assert 0 < parts and idle <= 2 * parts and idle < threads, woken


def _until_still(picks: list[tuple[str, bool]]) -> None:
    """Waits until no thread has looked for work for 0.3 s (at most 10 s): woken threads look late."""
    deadline = time.monotonic() + 10.0
    seen = -1
    while len(picks) != seen and time.monotonic() < deadline:
        seen = len(picks)
        time.sleep(0.3)


def test_parts_are_streamed_by_the_fetch_threads_into_the_copy(
        dataset: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part is one ranged GET made by the fetch thread that writes it, its body handed over in
    chunks as they arrive (:meth:`ObjectStore.stream_range`), each written and checksummed while it
    is in the CPU's cache: no part goes through the store's event-loop thread (its hand-over cost
    about 0.4 CPU s/GB) or is gathered into one buffer first. The copies are the exact shards."""
    from shardkit.stores import objectstore

    local, url = dataset
    monkeypatch.setattr(objectstore, "STREAM_CHUNK_BYTES", 16 << 10)  # parts of 128 KiB: several chunks each
    by_thread: list[str] = []
    chunks: list[int] = []
    async_shard_gets: list[str] = []
    real_stream, real_async = objectstore.ObjectStore.stream_range, objectstore.ObjectStore._get_range_async

    def stream(self: Any, r: Any, sink: Any, *, size: int) -> Any:
        by_thread.append(threading.current_thread().name)

        def counted(pos: int, chunk: memoryview) -> None:
            chunks.append(chunk.nbytes)
            sink(pos, chunk)

        return real_stream(self, r, counted, size=size)

    async def via_loop(self: Any, i: int, r: Any) -> Any:
        if r.key.startswith("image/c/"):
            async_shard_gets.append(r.key)
        return await real_async(self, i, r)

    monkeypatch.setattr(objectstore.ObjectStore, "stream_range", stream)
    monkeypatch.setattr(objectstore.ObjectStore, "_get_range_async", via_loop)
    cache = _cache(tmp_path)
    with Dataset(url, cache_dir=cache) as ds:
        check_batch({"key": np.arange(N), **ds.read(list(range(N)))})
        _wait_all(ds)
        st = ds.payload.prefetcher.stats  # type: ignore[attr-defined]
        parts = st.parts_demanded + st.parts_background
        assert st.reread_bytes == 0  # every chunk was checksummed as it landed
    assert async_shard_gets == []
    assert len(by_thread) == parts >= SHARDS * 5  # parts of at most two pages, shards of ten or more
    assert all(name.startswith("shardkit-prefetch-") for name in by_thread)
    # Parts are not gathered into one buffer (that gives exactly one chunk a part). How many chunks a
    # part arrives in depends on the client's reads (fewer, larger ones on a loaded machine).
    assert len(chunks) > parts and sum(chunks) == st.bytes
    assert [p.read_bytes() for p in _final_copies(cache)] == _shard_bytes(local)


def test_a_block_looks_each_shards_copy_up_once_not_per_run(dataset: tuple[Path, str], held: threading.Event,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold block of many runs per shard looks for each shard's complete copy a few times, not once
    per run (a copy being filled is not found: each look was a failed open of the file)."""
    _, url = dataset
    looks: list[str] = []
    real_open = cache_mod.ShardCache.open

    def counted(self: cache_mod.ShardCache, name: str, verify: Any) -> Any:
        looks.append(name)
        return real_open(self, name, verify)

    monkeypatch.setattr(cache_mod.ShardCache, "open", counted)
    keys = list(range(0, N, 2))  # every other record: PER_SHARD // 2 runs in each shard
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        check_batch({"key": np.array(keys), **ds.read(keys)})
    assert len(keys) // SHARDS >= 20
    assert len(looks) <= 3 * SHARDS, looks


def _counted_looks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times of every look at the cache's ask counter (:meth:`ShardCache.asked`) from now on."""
    looks: list[float] = []
    real = cache_mod.ShardCache.asked

    def asked(self: cache_mod.ShardCache) -> bytes:
        looks.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(cache_mod.ShardCache, "asked", asked)
    return looks


def _until(cond: Any, seconds: float = 20.0) -> bool:
    """Whether ``cond()`` came true within ``seconds`` (a bound against a hang, not a speed check)."""
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(cond())


def test_the_watcher_sleeps_until_another_process_asks(dataset: tuple[Path, str], held: threading.Event,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filler's watcher sleeps on its wake-up FIFO: another process's ask wakes it (it would
    otherwise sleep for the whole safety-net period), and it does not go on looking every few
    milliseconds after asks (each look takes the GIL from the fetch threads); its FIFO is removed
    when the prefetcher closes."""
    monkeypatch.setattr(prefetch, "QUIET_POLL_SECONDS", 60.0)
    monkeypatch.setattr(prefetch, "_WANTED_POLL_SECONDS", 60.0)
    looks = _counted_looks(monkeypatch)
    _, url = dataset
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read(ONE_PER_SHARD)  # the three copies are being filled; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        wake = pf.cache.root / "wake"
        assert [n for n in os.listdir(wake) if n.startswith("wake-")]
        assert _until(lambda: bool(looks))  # its first look
        other = cache_mod.ShardCache(pf.cache.root.parent, pf.cache.dir.name)  # as another process of the node
        try:
            for _ in range(3):
                n = len(looks)
                other.ask()
                assert _until(lambda n=n: len(looks) > n)  # woken by the ask
            n = len(looks)
            time.sleep(0.3)
            assert len(looks) == n  # no ask, no look (a poller looked every 2 ms after asks)
        finally:
            other.close()
        held.set()
    assert not os.listdir(wake)


def test_an_ask_removes_dead_fillers_fifos_and_writes_no_other_file(tmp_path: Path) -> None:
    """A wake-up FIFO without a reader is a dead filler's: the next ask removes it, as it does a
    hidden one a dead process was making. Its own FIFO and an entry that is not a FIFO are not
    written; another instance's live FIFO is."""
    cache = cache_mod.ShardCache(tmp_path, "ns")
    wake = cache.root / "wake"
    try:
        os.mkfifo(wake / "wake-1-dead", 0o600)
        os.mkfifo(wake / ".wake-999999999-making", 0o600)
        (wake / "wake-2-file").write_bytes(b"")
        os.chmod(wake / "wake-2-file", 0o600)
        own = cache.listen()
        assert own is not None
        cache.ask()
        assert own.wait(0.0) and not _fifo_bytes(wake / own.name)  # its own FIFO is not written
        assert sorted(os.listdir(wake)) == sorted(["wake-2-file", own.name])
        assert (wake / "wake-2-file").read_bytes() == b""
        listener = cache_mod.ShardCache(tmp_path, "ns")
        try:
            other = listener.listen()
            assert other is not None
            cache.ask()
            assert _fifo_bytes(wake / other.name) == b"\1"
            other.close()
            other.close()  # closed once: a second close does nothing
            assert other.closed and not other.wait(0.0)
        finally:
            listener.close()
        own.close()
    finally:
        cache.close()
    assert os.listdir(wake) == ["wake-2-file"]


def _fifo_bytes(path: Path) -> bytes:
    """What a FIFO holds now (read without blocking, through a descriptor of this test's own)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.read(fd, 16)
    except BlockingIOError:
        return b""
    finally:
        os.close(fd)


def test_the_watcher_polls_where_no_fifo_can_be_made(dataset: tuple[Path, str], held: threading.Event,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no wake-up FIFO can be made (here: ``wake`` is not a directory), a filler's watcher
    polls the ask counter: rarely while the process reads alone (its own readers never change the
    counter), often again once another process asks."""
    monkeypatch.setattr(prefetch, "QUIET_POLL_SECONDS", 0.1)
    looks = _counted_looks(monkeypatch)
    _, url = dataset
    root = cache_mod.cache_root(_cache(tmp_path))
    root.mkdir(mode=0o700)
    (root / "wake").write_bytes(b"")
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read(ONE_PER_SHARD)  # the three copies are being filled; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        assert pf.cache.listen() is None
        time.sleep(0.2)
        n = len(looks)
        time.sleep(1.0)
        alone = len(looks) - n
        other = cache_mod.ShardCache(root.parent, pf.cache.dir.name)
        try:
            other.ask()  # what another process does after it marked pages in a copy's map
        finally:
            other.close()
        time.sleep(0.1)
        n = len(looks)
        time.sleep(0.3)
        asking = len(looks) - n
    assert alone <= 1.0 / 0.1 + 2  # a look every 0.1 s at most (load only makes fewer)
    assert asking > alone * 0.3 / 1.0 + 2  # back to every ASK_POLL_SECONDS
    assert prefetch.ask_poll_seconds(0.0) == prefetch.ASK_POLL_SECONDS
    assert prefetch.ask_poll_seconds(prefetch.ASKING_SECONDS) == prefetch.QUIET_POLL_SECONDS
    assert (root / "wake").read_bytes() == b""


def _wake_fifo_fds() -> dict[int, str]:
    """This process's descriptors of fillers' wake-up FIFOs: number -> path (``/proc/self/fd``)."""
    out: dict[int, str] = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if os.path.basename(target).startswith("wake-"):
            out[int(n)] = target
    return out


def test_a_closed_fillers_wake_up_descriptor_is_never_used_again(dataset: tuple[Path, str], held: threading.Event,
                                                                 tmp_path: Path) -> None:
    """Once a prefetcher closed, its wake-up FIFO's descriptor number is forgotten: a descriptor this
    process opens afterwards under that number (an HTTP connection, say) is neither written to nor
    closed by a second close of the prefetcher, nor by the dataset's and the cache's."""
    _, url = dataset
    ds = Dataset(url, cache_dir=_cache(tmp_path))
    reused: int | None = None
    r = -1
    try:
        ds.read(ONE_PER_SHARD)  # the three copies are being filled; the background is held
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        fifos = _wake_fifo_fds()
        assert len(fifos) == 1, fifos
        (number,) = fifos
        r, w = os.pipe()  # (made first, so that neither end takes the number the close frees)
        os.set_blocking(r, False)
        held.set()
        pf.close()
        assert number not in _wake_fifo_fds()  # released by the close
        os.dup2(w, number)  # the number taken again by a new descriptor
        reused = number
        os.close(w)
        pf.close()  # a second close
        ds.close()
        with pytest.raises(BlockingIOError):
            os.read(r, 16)  # no stray byte was written to it
        assert os.fstat(number).st_ino == os.fstat(r).st_ino  # and it is still open, still the pipe
    finally:
        ds.close()
        for fd in (reused, r):
            if fd is not None and fd >= 0:
                with suppress(OSError):
                    os.close(fd)


def test_a_forked_child_leaves_its_parents_wake_up_fifo_alone(dataset: tuple[Path, str], held: threading.Event,
                                                             tmp_path: Path) -> None:
    """A child forked from a filler's process holds none of its wake-up FIFO's descriptors, and
    closing the prefetcher and the cache it inherited neither removes nor closes the parent's FIFO."""
    _, url = dataset
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read(ONE_PER_SHARD)
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        fifos = _wake_fifo_fds()
        assert len(fifos) == 1, fifos
        ((number, path),) = fifos.items()
        pid = os.fork()
        if pid == 0:  # the child: exits with 0 (nothing held), 2 (a FIFO descriptor inherited), else 1
            code = 1
            try:
                signal.alarm(30)
                held_at_fork = bool(_wake_fifo_fds())
                pf.close()
                pf.cache.close()
                code = 2 if held_at_fork else 0
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
        assert os.path.exists(path)  # the child did not remove it
        assert _wake_fifo_fds().get(number) == path  # nor close it here
        held.set()
