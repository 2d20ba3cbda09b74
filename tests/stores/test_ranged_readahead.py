"""Without a cache, the next block's first requests are started while the current block's are in
flight (its keys come from the order, told by the pipeline through ``read_ahead``), taken over by
the next read, never fetched twice, and dropped when the hint was wrong."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import open_dataset
from shardkit.readers import TieredSampler
from shardkit.stores import ByteRange, Fetched
from shardkit.stores.objectstore import ObjectStore
from tests.helpers.datasets import make_records, upload, write_dataset


class _Tracked(Iterator[Fetched]):
    """A started fetch whose deliveries are counted."""

    def __init__(self, inner: Iterator[Fetched], ranges: Sequence[ByteRange]) -> None:
        self.inner, self.ranges = inner, list(ranges)
        self.delivered = 0
        self.finished = False

    def __next__(self) -> Fetched:
        try:
            got = next(self.inner)
        except StopIteration:
            self.finished = True
            raise
        self.delivered += 1
        self.finished = self.delivered == len(self.ranges)
        return got

    def close(self) -> None:
        self.finished = True
        self.inner.close()  # type: ignore[attr-defined]


class _Watch:
    """Every started fetch, and which of them started while an earlier one had delivered nothing yet."""

    def __init__(self) -> None:
        self.started: list[_Tracked] = []
        self.overlapping: list[_Tracked] = []
        self.fetched = 0  # bytes of every ranged response of the payload's shards received, used or not


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> _Watch:
    w = _Watch()
    original = ObjectStore.start_fetch

    def start_fetch(self: ObjectStore, ranges: Sequence[ByteRange]) -> Any:
        busy = any(not t.finished and t.delivered == 0 for t in w.started)
        tracked = _Tracked(original(self, ranges), ranges)
        w.started.append(tracked)
        if busy:
            w.overlapping.append(tracked)
        return tracked

    received = ObjectStore._get_range_async

    async def get_range(self: ObjectStore, i: int, r: ByteRange) -> Fetched:
        got = await received(self, i, r)
        if r.key.startswith("image/c/"):  # the payload's shards (not its document, fetched with the fields')
            w.fetched += r.nbytes
        return got

    monkeypatch.setattr(ObjectStore, "start_fetch", start_fetch)
    monkeypatch.setattr(ObjectStore, "_get_range_async", get_range)
    return w


def _dataset(s3: Any, tmp_path: Path, n: int = 60) -> tuple[str, np.ndarray]:
    records = make_records(n)
    return upload(write_dataset(tmp_path / "ds", records, records_per_shard=20), s3.url("ds")), records


def test_next_read_starts_during_this_one_and_is_fetched_once(s3: Any, tmp_path: Path, watch: _Watch) -> None:
    url, records = _dataset(s3, tmp_path)
    first = np.array([1, 5, 22, 30, 41, 57])  # every shard, so their identities are checked by the first read
    second = np.array([8, 9, 26, 44, 50, 3])
    with open_dataset(url, remote_gap_bytes=0) as plain:
        counters = plain.payload.store.counters  # type: ignore[attr-defined]
        before = counters.bytes
        plain.payload.read(first)
        plain.payload.read(second)
        plain_requests, plain_bytes = plain.stats.read_calls, plain.stats.bytes_read
        plain_fetched = counters.bytes - before
    watch.started.clear()
    with open_dataset(url, remote_gap_bytes=0) as ds:
        counters = ds.payload.store.counters  # type: ignore[attr-defined]
        before = counters.bytes
        ds.payload.read_ahead(second)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(ds.payload.read(first), records[first])
        # The second read's requests were started while the first read's had delivered nothing.
        assert len(watch.overlapping) == 1
        early = watch.overlapping[0]
        size = records[0].nbytes
        # records 3 | 8-9 (shard 0), 26 (shard 1), 44 | 50 (shard 2): adjacent records share a request
        assert sorted((r.start // size, r.end // size) for r in early.ranges) == [(3, 4), (4, 5), (6, 7), (8, 10), (10, 11)]
        np.testing.assert_array_equal(ds.payload.read(second), records[second])
        # Taken over, not fetched again: the same requests and bytes as without the hint.
        assert (ds.stats.read_calls, ds.stats.bytes_read) == (plain_requests, plain_bytes)
        assert counters.bytes - before == plain_fetched


def test_a_wrong_hint_is_dropped_and_the_read_fetches_its_own(s3: Any, tmp_path: Path, watch: _Watch) -> None:
    url, records = _dataset(s3, tmp_path)
    first = np.array([1, 5, 22, 30, 41, 57])
    with open_dataset(url, remote_gap_bytes=0) as ds:
        ds.payload.read_ahead(np.array([8, 9, 26]))  # type: ignore[attr-defined]
        np.testing.assert_array_equal(ds.payload.read(first), records[first])
        assert len(watch.overlapping) == 1
        other = np.array([10, 11, 12, 45, 2])
        np.testing.assert_array_equal(ds.payload.read(other), records[other])
        assert watch.overlapping[0].finished  # closed: what it had not delivered was cancelled
        np.testing.assert_array_equal(ds.payload.read(np.array([8, 9, 26])), records[[8, 9, 26]])


@pytest.mark.parametrize("static", [0, 12])
def test_sampler_reads_ahead_without_fetching_more(s3: Any, tmp_path: Path, watch: _Watch, static: int) -> None:
    """Through the pipeline (with and without a static cache, whose pinned records are not read
    ahead): blocks after the first start while the one before is in flight, and an epoch fetches
    exactly its records (the shards' identity tails once per reader, in epoch 0)."""
    n = 60
    url, records = _dataset(s3, tmp_path, n)
    s = TieredSampler(url, batch_size=5, epochs=2, seed=3, ram_size="30records", static_cache=f"{static}records",
                      remote_gap_bytes=0, cache_dir=None)
    assert s.static_cache == static
    got = list(s)
    for b in got:
        np.testing.assert_array_equal(b["image"], records[b["key"]])
    keys = np.concatenate([b["key"] for b in got]).reshape(2, n)
    assert (np.sort(keys, axis=1) == np.arange(n)).all()
    assert len(watch.overlapping) >= 3
    # epoch 1: the records the static cache does not hold, each once (pinned ones were read in epoch 0)
    assert s.stats.disk_bytes_by_epoch[1] == (n - static) * records[0].nbytes
    # nothing fetched ahead went unused (a pinned record in the hint would be)
    assert watch.fetched == sum(s.stats.disk_bytes_by_epoch.values())
