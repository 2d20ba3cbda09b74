"""Ranged requests in flight: every fetch of one object store shares ``StoreOptions.concurrency``
slots, first started first served, so a reader can start its next block's requests early without
exceeding the limit or delaying the current block. Driven through a fake obstore whose requests
wait on an event: the tests force the interleaving, they never wait and hope."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from shardkit.stores import ByteRange, StoreOptions
from shardkit.stores import objectstore as objectstore_module
from shardkit.stores.objectstore import ObjectStore

pytest.importorskip("obstore")

OBJECT = bytes(range(256)) * 64  # 16 KiB


class _Response:
    def __init__(self, data: bytes) -> None:
        self.meta = {"size": len(OBJECT), "e_tag": '"v1"'}
        self._data = data

    async def bytes_async(self) -> bytes:
        return self._data


class _GatedObstore:
    """``get_async`` records each request as it starts and answers once :attr:`gate` is open."""

    def __init__(self, hold: int) -> None:
        self.started: list[tuple[str, int]] = []
        self.hold = hold  # when this many requests have started, :attr:`holding` is set
        self.holding = threading.Event()
        self.gate: asyncio.Event | None = None

    async def get_async(self, inner: Any, key: str, *, options: dict[str, Any]) -> _Response:
        if self.gate is None:
            self.gate = asyncio.Event()
        start, end = options["range"]
        self.started.append((key, start))
        if len(self.started) >= self.hold:
            self.holding.set()
        await self.gate.wait()
        return _Response(OBJECT[start:end])


def _store(concurrency: int, fake: _GatedObstore) -> ObjectStore:
    store = ObjectStore("s3://bucket/prefix", inner=None, options=StoreOptions(concurrency=concurrency))
    store._obs = fake
    return store


def _settle() -> None:
    """Let every task the store's event loop can run take its turn (a few full passes of its ready
    queue), so a request that could start has started."""

    async def passes() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    objectstore_module._get_runner().submit(passes()).result(timeout=30)


def _open(fake: _GatedObstore) -> None:
    runner = objectstore_module._get_runner()
    assert fake.gate is not None
    runner.loop.call_soon_threadsafe(fake.gate.set)


def test_overlapping_fetches_share_the_store_concurrency() -> None:
    fake = _GatedObstore(hold=4)
    store = _store(4, fake)
    first = store.start_fetch([ByteRange("a", 100 * i, 100 * i + 100) for i in range(10)])
    second = store.start_fetch([ByteRange("b", 100 * i, 100 * i + 100) for i in range(10)])
    assert fake.holding.wait(30)
    _settle()
    # Four requests in flight, all of the fetch started first; the second waits for free slots.
    assert fake.started == [("a", 0), ("a", 100), ("a", 200), ("a", 300)]
    assert store.counters.in_flight == 4
    _open(fake)
    got_first = sorted((f.index, bytes(f.data)) for f in first)
    got_second = sorted((f.index, bytes(f.data)) for f in second)
    assert got_first == [(i, OBJECT[100 * i : 100 * i + 100]) for i in range(10)]
    assert [i for i, _ in got_second] == list(range(10))
    # First come, first served: every request of the first fetch started before any of the second.
    assert [k for k, _ in fake.started] == ["a"] * 10 + ["b"] * 10
    assert store.counters.max_in_flight == 4 and store.counters.in_flight == 0


def test_closing_a_started_fetch_cancels_what_it_has_not_delivered() -> None:
    fake = _GatedObstore(hold=2)
    store = _store(2, fake)
    ahead = store.start_fetch([ByteRange("a", 100 * i, 100 * i + 100) for i in range(8)])
    assert fake.holding.wait(30)
    ahead.close()
    _settle()
    after = store.start_fetch([ByteRange("b", 0, 100)])
    _settle()
    _open(fake)
    assert [bytes(f.data) for f in after] == [OBJECT[:100]]
    # The cancelled fetch freed its slots and started nothing more.
    assert [k for k, _ in fake.started] == ["a", "a", "b"]
    assert list(ahead) == []
    assert store.counters.in_flight == 0


class _GatedSyncObstore(_GatedObstore):
    """Also answers synchronous ``get`` (:meth:`ObjectStore.fetch_range`), held by the same gate."""

    def __init__(self, hold: int) -> None:
        super().__init__(hold)
        self.sync_gate = threading.Event()

    def get(self, inner: Any, key: str, *, options: dict[str, Any]) -> Any:
        start, end = options["range"]
        self.started.append((key, start))
        assert self.sync_gate.wait(30)
        response = _Response(OBJECT[start:end])
        response.bytes = lambda: OBJECT[start:end]  # type: ignore[attr-defined]
        return response


def _until(done: Any, what: str) -> None:
    """Until ``done()`` (each step a full pass of the event loop's ready queue), or fail naming ``what``."""
    for _ in range(3000):
        if done():
            return
        _settle()
    raise AssertionError(f"expected {what}")


def _waiting(store: ObjectStore, n: int) -> None:
    _until(lambda: len(store._slots._waiters) == n, f"{n} requests waiting for a slot")


def test_a_thread_fetching_a_range_itself_takes_a_slot_in_turn() -> None:
    """:meth:`ObjectStore.fetch_range` (a synchronous GET in the calling thread, as the cache's fetch
    threads make) waits for one of the store's slots like a started fetch, first asked first served:
    with the one slot held, the thread's request starts when it is freed, before that of a fetch
    started after the thread asked, which starts only when the thread's request is done."""
    fake = _GatedSyncObstore(hold=1)
    store = _store(1, fake)
    first = store.start_fetch([ByteRange("a", 0, 100)])
    assert fake.holding.wait(30)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(bytes(store.fetch_range(ByteRange("t", 300, 400)).data)))
    thread.start()
    _waiting(store, 1)
    later = store.start_fetch([ByteRange("b", 0, 100)])
    _waiting(store, 2)
    assert fake.started == [("a", 0)]  # both wait: the slot is taken
    _open(fake)
    assert [bytes(f.data) for f in first] == [OBJECT[:100]]
    _until(lambda: ("t", 300) in fake.started, "the thread's request to start")  # the freed slot went to it
    _settle()
    assert len(store._slots._waiters) == 1  # the fetch started later still waits
    assert fake.started[:2] == [("a", 0), ("t", 300)] and ("b", 0) not in fake.started
    assert store.counters.in_flight == 1
    fake.sync_gate.set()
    thread.join(30)
    assert got == [OBJECT[300:400]]
    assert [bytes(f.data) for f in later] == [OBJECT[:100]]
    assert fake.started == [("a", 0), ("t", 300), ("b", 0)]
    assert store.counters.max_in_flight == 1 and store.counters.in_flight == 0
    assert store._slots._free == 1 and not store._slots._waiters
