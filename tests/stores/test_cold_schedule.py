"""A cold epoch downloads parts in the order its blocks need them (issue 32, cached cold epoch):
the pipeline hands the reader the epoch's block schedule up front, and the background order
follows it part by part instead of shard by shard."""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import Dataset, ranged
from shardkit.readers import TieredSampler
from shardkit.stores import cache as cache_mod
from shardkit.stores import prefetch
from tests.helpers.cli import run_main
from tests.helpers.sampler_data import check_batch
from tests.helpers.small_parts import PER_SHARD, RECORDS_PER_PART, N, small_parts_url
from tests.helpers.small_parts import cache_dir as _cache


@pytest.fixture
def url(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return small_parts_url(s3, tmp_path, monkeypatch, "schedule")


def _record_picks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """``(shard, first page, asked for)`` of every part the prefetchers pick, in pick order (picks
    happen one at a time, under the prefetcher's lock)."""
    picks: list[tuple[int, int, bool]] = []
    real = prefetch.ShardPrefetcher._pick

    def pick(self: prefetch.ShardPrefetcher) -> Any:
        got = real(self)
        if got is not None:
            picks.append((got[0].index, got[1], got[3]))
        return got

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_pick", pick)
    return picks


def _part_of(key: int) -> tuple[int, int]:
    """(shard, first page) of the part that holds record ``key``."""
    return key // PER_SHARD, key % PER_SHARD // RECORDS_PER_PART * 2


def test_background_parts_follow_the_block_schedule(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts the first scheduled block needs are fetched first (in shard order within the
    block), then those the next block adds; shard by shard, shard 0's first part would come first."""
    picks = _record_picks(monkeypatch)
    blocks = [np.array([2 * PER_SHARD + 35, PER_SHARD + 20]), np.array([PER_SHARD + 21, 9, 2 * PER_SHARD + 1])]
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.payload.schedule(iter(blocks))  # type: ignore[attr-defined]
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        for i in range(len(pf.items)):
            pf.wait(i)
    expected = [_part_of(PER_SHARD + 20), _part_of(2 * PER_SHARD + 35),  # block 1 (its shards ascending)
                _part_of(9), _part_of(2 * PER_SHARD + 1)]  # block 2 adds these (key 61's part is block 1's)
    assert [(i, lo) for i, lo, _ in picks[: len(expected)]] == expected, picks
    assert not any(demanded for _, _, demanded in picks)
    assert len({(i, lo) for i, lo, _ in picks}) == len(picks) >= 3 * 5  # each part once


def test_the_pipeline_hands_over_the_epochs_blocks(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's pipeline gives the reader its block schedule before the first read: the blocks
    it hands over, concatenated, are the epoch's order, and no part was picked before."""
    picks = _record_picks(monkeypatch)
    handed: list[np.ndarray] = []
    at_schedule: list[int] = []
    real = ranged.RangedPayloadArray.schedule

    def schedule(self: ranged.RangedPayloadArray, blocks: Any) -> None:
        at_schedule.append(len(picks))
        seen = [np.array(b) for b in blocks]
        handed.extend(seen)
        real(self, iter(seen))

    monkeypatch.setattr(ranged.RangedPayloadArray, "schedule", schedule)
    lock = threading.Lock()
    keys: list[np.ndarray] = []
    with TieredSampler(url, tiers="ram", ram_size=N // 4 * 16384, batch_size=8, epochs=1, seed=3,
                       cache_dir=_cache(tmp_path)) as s:
        for batch in s:
            with lock:
                keys.append(np.asarray(batch["key"]))
    assert at_schedule == [0]
    assert len(handed) > 2  # several blocks, the first ones small
    np.testing.assert_array_equal(np.concatenate(handed), np.concatenate(keys))


def test_a_claimed_copy_is_allocated_at_once(tmp_path: Path) -> None:
    """A new copy's blocks are allocated when it is claimed (writes into allocated space cost a
    fraction of the CPU of writes that allocate), its bytes still all zero until parts land."""
    c = cache_mod.ShardCache(_cache(tmp_path), "ns")
    try:
        fd = c.claim("shard-00000000", 3 << 20)
        assert fd is not None
        try:
            st = os.fstat(fd)
            assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
            assert os.pread(fd, 1 << 20, 1 << 20) == bytes(1 << 20)
        finally:
            c.abandon("shard-00000000", fd)
    finally:
        c.close()


def test_a_copy_that_does_not_fit_is_refused_before_any_byte_is_fetched(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk cannot hold shard 1: its claim fails out of space, nothing of it is downloaded into
    the cache, its records are read by range and equal the local ones; the other shards are cached."""
    picks = _record_picks(monkeypatch)
    real = os.posix_fallocate
    sizes: list[int] = []

    def allocate(fd: int, offset: int, length: int) -> None:
        sizes.append(length)
        if len(sizes) == 2:  # the second claim: shard 1 (shards are claimed in order, one thread picks)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", allocate)
    cache = _cache(tmp_path)
    keys = [3, PER_SHARD + 17, 2 * PER_SHARD + 30]
    with Dataset(url, cache_dir=cache) as ds:
        ds.payload.schedule(iter([np.array(keys)]))  # type: ignore[attr-defined]
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        for i in range(len(pf.items)):
            pf.wait(i)
        got = ds.read(keys)
    check_batch({"key": np.array(keys), **got})
    assert {i for i, _, _ in picks} == {0, 2}, picks  # nothing of shard 1 was fetched into the cache
    names = sorted(p.name for p in cache.rglob("*shard-*"))
    assert names == ["shard-00000000", "shard-00000002"], names


def test_epoch_counts_include_parts_landing_between_blocks(url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes and requests per epoch count the whole download, also the parts that land while no
    block is being read (here: every background part, held until the first block was handed on),
    and the sampler's stats carry the download's summary."""
    from shardkit.tiers import pipeline

    hold = threading.Event()
    monkeypatch.setattr(prefetch, "hold_background", hold)
    real_put = pipeline.Pipeline._put
    first: list[Any] = []

    def put(self: pipeline.Pipeline, q: Any, item: Any) -> None:
        if isinstance(item, pipeline.BlockRead) and not first:
            first.append(item)
            hold.set()  # the background runs now, and lands before the next block is read
            pf = self.disk.payload.prefetcher  # type: ignore[union-attr]
            for i in range(len(pf.items)):
                pf.wait(i)
        real_put(self, q, item)

    monkeypatch.setattr(pipeline.Pipeline, "_put", put)
    with TieredSampler(url, tiers="ram", ram_size=N // 4 * 16384, batch_size=8, epochs=1, seed=3,
                       cache_dir=_cache(tmp_path)) as s:
        seen = sum(check_batch(b).size for b in s)
        st = s.stats
        dataset_bytes = sum(info.nbytes for info in Dataset(url).payload.shards)
    assert seen == N and first
    assert sum(st.disk_bytes_by_epoch.values()) == st.disk.bytes_read >= dataset_bytes
    assert sum(st.disk_requests_by_epoch.values()) == st.disk.read_calls
    assert st.download_bytes >= dataset_bytes and st.download_parts >= 3 * 5
    assert st.download_wait_seconds >= 0.0 and st.download_cpu_seconds > 0.0


def test_profile_and_sample_report_the_download(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``shardkit profile`` and ``shardkit sample`` say what the cold pass downloaded into the cache
    (bytes, parts, the readers' wait), and its bytes per epoch count the whole download."""
    from shardkit.profiling import profile, report_lines

    prof = profile(url, step_time="1ms", batch_size=8, ram_size="30records", cache_dir=_cache(tmp_path))
    cold = prof.phases["ingest-cold"]
    assert cold.download_parts >= 3 * 5 and cold.download_bytes >= prof.workload.dataset_bytes
    assert sum(cold.epoch_storage_bytes) == cold.storage_bytes and sum(cold.epoch_storage_calls) == cold.storage_calls
    text = "\n".join(report_lines(prof))
    assert f"downloaded into the local cache in {cold.download_parts} parts; readers waited" in text
    other = tmp_path / "other-cache"
    other.mkdir()
    assert run_main("sample", url, "--batch-size", "8", "--ram-size", "30records", "--cache-dir", str(other)) == 0
    out = capsys.readouterr().out
    assert "download     " in out and " into the local cache in " in out.split("download     ")[1].splitlines()[0]


def _held_fetches(monkeypatch: pytest.MonkeyPatch, passes: set[tuple[int, int]]) -> tuple[list[tuple[int, int]], threading.Event]:
    """Every part the prefetchers fetch is recorded as ``(item, first page)`` and held at a gate,
    except those of ``passes``, which go through at once."""
    entered: list[tuple[int, int]] = []
    lock, gate = threading.Lock(), threading.Event()
    real = prefetch.ShardPrefetcher._fetch

    def fetch(self: prefetch.ShardPrefetcher, fill: Any, lo: int, hi: int) -> bool:
        with lock:
            entered.append((fill.index, lo))
        if (fill.index, lo) not in passes:
            gate.wait(60)
        return real(self, fill, lo, hi)

    monkeypatch.setattr(prefetch.ShardPrefetcher, "_fetch", fetch)
    return entered, gate


def _until(cond: Any) -> None:
    for _ in range(1000):  # bounded: 10 s
        if cond():
            return
        threading.Event().wait(0.01)


def test_a_cold_download_opens_with_two_background_parts_then_the_most(url: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """While nobody has asked, the background keeps OPENING_BACKGROUND parts in flight (a first block's
    asks will not queue behind a full width of parts nobody waits for); once OPENING_SECONDS pass
    with no ask, MAX_PARTS_IN_FLIGHT are in flight before any has landed (no ramp that waits for
    measured throughput)."""
    monkeypatch.setattr(prefetch, "OPENING_SECONDS", 600.0)
    entered, gate = _held_fetches(monkeypatch, set())
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        try:
            ds.payload.schedule(iter([]))  # type: ignore[attr-defined]  # starts the download, no block yet
            pf = ds.payload.prefetcher  # type: ignore[attr-defined]
            per = prefetch.PART_BYTES // cache_mod.PAGE_BYTES
            parts = sum(-(-cache_mod.map_pages(item.size) // per) for item in pf.items)
            want = min(prefetch.MAX_PARTS_IN_FLIGHT, pf.store.options.concurrency, parts)
            _until(lambda: len(entered) >= prefetch.OPENING_BACKGROUND)
            threading.Event().wait(0.3)  # room for a wrong third part to start
            opening = len(entered)
            monkeypatch.setattr(prefetch, "OPENING_SECONDS", 0.0)  # seen at the threads' next look (<= 1 s)
            _until(lambda: len(entered) >= want)
            in_flight = len(entered)
        finally:
            gate.set()
        for i in range(len(pf.items)):
            pf.wait(i)
    assert opening == prefetch.OPENING_BACKGROUND == 2
    assert parts > prefetch.MAX_PARTS_IN_FLIGHT
    assert in_flight == want == prefetch.MAX_PARTS_IN_FLIGHT, in_flight
    assert len(set(entered)) == len(entered) == parts  # each part once, all of them


def test_the_background_widens_once_the_first_asked_pages_land(url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's first ask is fetched beside the two opening background parts, and once its pages
    have landed the background goes to its full width at once (not after OPENING_SECONDS)."""
    monkeypatch.setattr(prefetch, "OPENING_SECONDS", 600.0)
    last = 2  # an item the background order reaches last
    entered, gate = _held_fetches(monkeypatch, {(last, 0)})
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        try:
            ds.payload.schedule(iter([]))  # type: ignore[attr-defined]
            pf = ds.payload.prefetcher  # type: ignore[attr-defined]
            _until(lambda: len(entered) >= prefetch.OPENING_BACKGROUND)
            threading.Event().wait(0.3)
            before_ask = len(entered)
            pf._demanded(last, [(0, 1)])  # the first block's ask: one page
            _until(lambda: len(entered) >= prefetch.MAX_PARTS_IN_FLIGHT + 1)
            after_ask = len(entered)
        finally:
            gate.set()
        for i in range(len(pf.items)):
            pf.wait(i)
    assert before_ask == prefetch.OPENING_BACKGROUND
    assert (last, 0) in entered[before_ask:]
    assert after_ask >= prefetch.MAX_PARTS_IN_FLIGHT + 1  # the asked one and the full width (its measure may add parts)


def test_a_cold_cached_epoch_sorts_its_keys_without_numpy_unique(url: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's schedule and reads use ``distinct_sorted``: numpy's ``unique`` hashes integers
    (slower on a block's keys) and its first call imports ``numpy.ma`` in the reader's thread, before
    a fresh process's first block."""
    callers: list[str] = []
    real = np.unique

    def spy(*args: Any, **kwargs: Any) -> Any:
        callers.append(sys._getframe(1).f_code.co_filename)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "unique", spy)
    with TieredSampler(url, tiers="ram", ram_size=N // 4 * 16384, batch_size=8, epochs=1, seed=3,
                       cache_dir=_cache(tmp_path)) as s:
        seen = sum(check_batch(b).size for b in s)
    assert seen == N
    assert not [c for c in callers if c.endswith(os.path.join("formats", "ranged.py"))]
