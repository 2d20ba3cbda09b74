"""The background download's width follows the link (issue 32, cold epoch at 20-50 ms): parts
waiting for their first byte get slots of their own on top of the streaming ones, so a slow first
byte does not leave the link with fewer parts receiving (docs/design.md §9, *Shard cache*)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from shardkit.formats import Dataset
from shardkit.stores import prefetch
from shardkit.stores.objectstore import ObjectStore
from tests.helpers.small_parts import cache_dir, small_parts_url

LATENCY_S = 0.1


def test_parts_in_flight_adds_the_parts_waiting_for_their_first_byte() -> None:
    """Little's law: parts start at rate / part a second and each waits the latency, so
    rate * latency / part of them wait; they come on top of the streaming width, within the cap."""
    mib = 1 << 20
    assert prefetch.parts_in_flight(16, 400e6, 0.05, 8 * mib, 32) == 16 + 3  # 20 MB waiting: 2.4 parts
    assert prefetch.parts_in_flight(16, 400e6, 0.0, 8 * mib, 32) == 16  # no latency: the streaming width
    assert prefetch.parts_in_flight(16, 0.0, 0.05, 8 * mib, 32) == 16  # nothing landed yet
    assert prefetch.parts_in_flight(16, 400e6, 0.5, 8 * mib, 32) == 32  # never past the store's concurrency
    assert prefetch.parts_in_flight(16, 400e6, 0.05, 8 * mib, 8) == 8


def test_a_slow_first_byte_widens_the_background(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part waits LATENCY_S before its first byte: once parts have landed, more than
    MAX_PARTS_IN_FLIGHT are in flight (those waiting on top of the streaming ones), and the copies
    are complete, each part fetched once."""
    url = small_parts_url(s3, tmp_path, monkeypatch, "width")
    monkeypatch.setattr(prefetch, "MAX_PARTS_IN_FLIGHT", 2)
    monkeypatch.setattr(prefetch, "OPENING_SECONDS", 0.0)  # the width rule alone, from the first part
    lock, now, most, ranges = threading.Lock(), [0], [0], []
    real = ObjectStore.stream_range

    def slow_first_byte(self: ObjectStore, r: Any, sink: Any, *, size: int) -> str | None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            ranges.append((r.key, r.start))
        try:
            time.sleep(LATENCY_S)
            return real(self, r, sink, size=size)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(ObjectStore, "stream_range", slow_first_byte)
    with Dataset(url, cache_dir=cache_dir(tmp_path)) as ds:
        ds.payload.schedule(iter([]))  # type: ignore[attr-defined]  # starts the download, no block yet
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        for i in range(len(pf.items)):
            assert pf.wait(i)
        width = pf.stats.width
    assert len(ranges) > 4 * prefetch.MAX_PARTS_IN_FLIGHT
    assert most[0] > prefetch.MAX_PARTS_IN_FLIGHT, most[0]
    assert width > prefetch.MAX_PARTS_IN_FLIGHT, width
    assert len(set(ranges)) == len(ranges)  # each part once
