"""``ObjectStore.stream_range``: one ranged GET whose body is handed to a sink in chunks as it
arrives (the cache's fetch threads write and checksum each chunk while it is in the CPU's cache).
Driven through a fake obstore: a body cut short is retried from the range's start, a sink's own
error is raised as it is (never retried, never turned into a store error), the slot is given back."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest

from shardkit.errors import TruncatedShardError
from shardkit.stores import ByteRange, StoreOptions
from shardkit.stores.objectstore import ObjectStore

pytest.importorskip("obstore")

OBJECT = bytes(range(256)) * 64  # 16 KiB


class _Response:
    def __init__(self, body: bytes, chunk: int) -> None:
        self.meta = {"size": len(OBJECT), "e_tag": '"v1"'}
        self._body, self._chunk = body, chunk

    def stream(self, min_chunk_size: int) -> Iterator[bytes]:
        for a in range(0, len(self._body), self._chunk):
            yield self._body[a : a + self._chunk]


class _Obstore:
    """Answers synchronous ranged ``get`` in chunks of 1 KiB; the first ``short`` bodies end early."""

    def __init__(self, short: int = 0) -> None:
        self.calls = 0
        self.short = short

    def get(self, inner: Any, key: str, *, options: dict[str, Any]) -> _Response:
        self.calls += 1
        start, end = options["range"]
        body = OBJECT[start:end]
        if self.calls <= self.short:
            body = body[: len(body) // 2]
        return _Response(body, 1024)


def _store(fake: _Obstore) -> ObjectStore:
    store = ObjectStore("s3://bucket/prefix", inner=None, options=StoreOptions(concurrency=1, backoff_initial=0.001))
    store._obs = fake
    return store


def test_a_body_cut_short_is_streamed_again_from_the_start() -> None:
    fake = _Obstore(short=1)
    store = _store(fake)
    seen: list[tuple[int, bytes]] = []
    etag = store.stream_range(ByteRange("k", 1000, 9000), lambda pos, chunk: seen.append((pos, bytes(chunk))),
                              size=len(OBJECT))
    assert etag == '"v1"' and fake.calls == 2 and store.counters.retries == 1
    restart = [k for k, (pos, _) in enumerate(seen) if pos == 1000]
    assert len(restart) == 2  # the sink saw the start twice: it starts over (its checksums too)
    again = seen[restart[1] :]
    assert b"".join(c for _, c in again) == OBJECT[1000:9000]
    assert [pos for pos, _ in again] == list(range(1000, 9000, 1024))
    assert store._slots._free == 1


def test_a_sinks_error_is_raised_as_it_is_not_retried() -> None:
    fake = _Obstore()
    store = _store(fake)

    def full(pos: int, chunk: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        store.stream_range(ByteRange("k", 0, 4096), full, size=len(OBJECT))
    assert caught.value.errno == errno.ENOSPC  # the prefetcher refuses the copy on it (out of space)
    assert fake.calls == 1 and store.counters.retries == 0
    assert store._slots._free == 1 and store.counters.in_flight == 0


def test_an_object_of_another_size_is_refused_before_any_byte() -> None:
    store = _store(_Obstore())
    seen: list[int] = []
    with pytest.raises(TruncatedShardError, match="expected 20000 bytes, the store says 16384"):
        store.stream_range(ByteRange("k", 0, 4096), lambda pos, chunk: seen.append(pos), size=20000)
    assert seen == []
