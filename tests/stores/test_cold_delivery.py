"""A cold block's records are copied into its rows by the fetch threads as their chunks land
(issue 32, the cached cold epoch): no read back from the cache copy for them, and only bytes of
parts that passed every check are ever delivered (docs/design.md §9, *Shard cache*)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import StoreError
from shardkit.formats import Dataset, ranged
from shardkit.stores import ByteRange, ObjectStore, prefetch
from shardkit.stores import cache as cache_mod
from tests.helpers.sampler_data import check_batch, encode
from tests.helpers.small_parts import PER_SHARD, SHAPE, N, small_parts_url
from tests.helpers.small_parts import cache_dir as _cache

REC = int(np.prod(SHAPE))
KEYS = [3, 17, PER_SHARD + 21, 2 * PER_SHARD + 30]  # on distinct pages and parts


@pytest.fixture
def url(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(prefetch, "hold_background", threading.Event())  # only asked-for pages flow
    return small_parts_url(s3, tmp_path, monkeypatch, "delivery")


def _copy_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``(what, offset)`` of every record read back from a cache copy."""
    reads: list[tuple[str, int]] = []
    real = ranged.preadv_exact

    def preadv(fd: int, buffers: Any, offset: int, what: str) -> None:
        reads.append((what, offset))
        real(fd, buffers, offset, what)

    monkeypatch.setattr(ranged, "preadv_exact", preadv)
    return reads


def _streams(monkeypatch: pytest.MonkeyPatch,
             before: Callable[[ByteRange, Callable[[int, memoryview], None]], None]) -> None:
    """Call ``before(range, sink)`` ahead of every part the prefetcher streams."""
    real = ObjectStore.stream_range

    def stream_range(self: ObjectStore, r: ByteRange, sink: Callable[[int, memoryview], None], *, size: int) -> str | None:
        before(r, sink)
        return real(self, r, sink, size=size)

    monkeypatch.setattr(ObjectStore, "stream_range", stream_range)


def _garbage_first(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, int]]:
    """Every part's first response hands over wrong bytes before it is streamed again from its first
    byte (as the store does when a body is cut short); returns the parts seen, ``(key, start)``."""
    seen: set[tuple[str, int]] = set()

    def garbage_first(r: ByteRange, sink: Callable[[int, memoryview], None]) -> None:
        if (r.key, r.start) not in seen:
            seen.add((r.key, r.start))
            sink(r.start, memoryview(b"\xff" * r.nbytes))

    _streams(monkeypatch, garbage_first)
    return seen


def test_a_waiting_blocks_records_are_copied_from_the_arriving_chunks(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first block's records (every page still to fetch) land in their rows from the parts'
    chunks: all of them delivered, none read back from the copy, and equal to the written ones."""
    reads = _copy_reads(monkeypatch)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        got = ds.read(KEYS)
        st = ds.payload.prefetcher.stats  # type: ignore[attr-defined]
    check_batch({"key": np.array(KEYS), **got})
    assert st.delivered_bytes == len(KEYS) * REC
    assert not [w for w, _ in reads if "local cache copy" in w], reads


def test_a_retried_part_delivers_its_last_response(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part's first response hands over wrong bytes and is then streamed again from its first
    byte (as the store does when a body is cut short): the rows hold the second response's bytes."""
    seen = _garbage_first(monkeypatch)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        got = ds.read(KEYS)
        st = ds.payload.prefetcher.stats  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got["image"], encode(np.array(KEYS), SHAPE))
    assert st.delivered_bytes == len(KEYS) * REC and seen


def _deliveries(monkeypatch: pytest.MonkeyPatch) -> list[prefetch.Delivery]:
    """Every :class:`~shardkit.stores.prefetch.Delivery` a block registers."""
    deliveries: list[prefetch.Delivery] = []
    real_deliver = prefetch.PartialCopy.deliver

    def deliver(self: prefetch.PartialCopy, *args: Any) -> prefetch.Delivery | None:
        d = real_deliver(self, *args)
        if d is not None:
            deliveries.append(d)
        return d

    monkeypatch.setattr(prefetch.PartialCopy, "deliver", deliver)
    return deliveries


def test_a_failed_part_delivers_nothing(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose chunks were copied into the rows and that then fails is never delivered: the
    block read raises the failure, and no record counts as delivered."""
    deliveries = _deliveries(monkeypatch)

    def copied_then_failed(r: ByteRange, sink: Callable[[int, memoryview], None]) -> None:
        sink(r.start, memoryview(b"\xff" * r.nbytes))
        raise StoreError(f"{r.key}: the server went away (injected)")

    _streams(monkeypatch, copied_then_failed)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds, pytest.raises(StoreError, match="injected"):
        ds.read(KEYS)
    assert deliveries
    assert not any(any(d.delivered()) for d in deliveries), [(d.which, d.offs, d.ends, d.got, d.fill.index) for d in deliveries]
    assert not any(d in d.fill.deliveries for d in deliveries)  # unregistered: no copy into the rows after


def test_a_delivery_taken_back_lets_go_of_its_rows(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a block read returns, the deliveries it registered view none of its rows, however long
    something keeps them (a fetch thread keeps the last one it looked at): a batch buffer viewed
    by one could not be reused, and the pool would replace it with fresh memory."""
    deliveries = _deliveries(monkeypatch)  # kept here, as a fetch thread's loop variable keeps one
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        got = ds.read(KEYS)
    assert deliveries
    payload = got["image"]
    rows = weakref.ref(payload if payload.base is None else payload.base)
    del got, payload
    assert rows() is None, [len(d.rows) for d in deliveries]


def test_a_shard_fetched_whole_is_read_from_its_copy(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard of one part is fetched by one GET without a range (no chunks to copy from): its
    records registered for delivery are read from the copy, and equal the written ones."""
    monkeypatch.setattr(prefetch, "PART_BYTES", 64 * cache_mod.PAGE_BYTES)  # every shard in one part
    reads = _copy_reads(monkeypatch)
    deliveries = _deliveries(monkeypatch)
    whole: list[str] = []
    real_download = ObjectStore.download

    def download(self: ObjectStore, key: str, fd: int, **kw: Any) -> str | None:
        whole.append(key)
        return real_download(self, key, fd, **kw)

    monkeypatch.setattr(ObjectStore, "download", download)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.payload._blocks_read = 1  # type: ignore[attr-defined]  # a later block: it asks for whole parts
        got = ds.read(KEYS)
        st = ds.payload.prefetcher.stats  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got["image"], encode(np.array(KEYS), SHAPE))
    assert st.delivered_bytes == 0 and len(whole) == 3 and deliveries, (whole, deliveries)
    assert len([w for w, _ in reads if "local cache copy" in w]) == len(KEYS)


def test_a_record_a_streaming_part_has_not_reached_is_delivered_from_it(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that asks while a part is streaming gets the records the part has not reached yet
    from its chunks; those it has passed are read from the copy (they are no longer in the chunks)."""
    monkeypatch.setattr(prefetch, "PART_BYTES", 8 * cache_mod.PAGE_BYTES)  # parts of 32 records
    slice_bytes = cache_mod.PAGE_BYTES
    paused, go = threading.Event(), threading.Event()
    real = ObjectStore.stream_range

    def stream_range(self: ObjectStore, r: ByteRange, sink: Callable[[int, memoryview], None], *, size: int) -> str | None:
        def sliced(pos: int, chunk: memoryview) -> None:
            for a in range(0, chunk.nbytes, slice_bytes):
                sink(pos + a, chunk[a : a + slice_bytes])
                if r.start == 0 and pos + a == 0:  # the first part's first page is in: hold it there
                    paused.set()
                    assert go.wait(60)

        return real(self, r, sliced, size=size)

    monkeypatch.setattr(ObjectStore, "stream_range", stream_range)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        payload: Any = ds.payload
        payload.schedule(iter([]))  # starts the download, the background held back
        pf = payload.prefetcher
        copy = pf.copy(0)
        assert copy is not None and copy.owned
        offs = payload.index(0).offsets
        keys = [2, 20]  # on the held page, and past it
        rows = np.zeros((len(keys), REC), dtype=np.uint8)
        try:
            copy.request([(0, 8)])
            assert paused.wait(60)
            delivery = copy.deliver([int(offs[k]) for k in keys], [int(offs[k]) + REC for k in keys],
                                    [memoryview(row) for row in rows])
            go.set()
            assert delivery is not None and delivery.which == [1]
            assert copy.wait([(0, 8)])
            copy.undeliver(delivery)
        finally:
            go.set()
            copy.close()
    assert delivery.delivered() == [True]
    np.testing.assert_array_equal(rows[1], encode(np.array([20]), SHAPE).reshape(-1))
    assert not rows[0].any()  # never handed over: read from the copy by a block


def test_a_block_does_not_wait_for_a_landed_copy_to_be_checked_and_named(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block waiting on a copy whose last part lands reads its records from the copy while the
    copy is still being checked and renamed (its fsync can take long on a busy disk), not after."""
    release = threading.Event()
    real = cache_mod.ShardCache.complete

    def complete(self: cache_mod.ShardCache, name: str, fd: int, size: int, verify: Callable[[int], bool]) -> bool:
        release.wait(60)
        return real(self, name, fd, size, verify)

    monkeypatch.setattr(cache_mod.ShardCache, "complete", complete)
    keys = list(range(PER_SHARD))  # every record of shard 0: once one block was read, its whole parts
    got: dict[str, Any] = {}
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        try:
            ds.read([PER_SHARD + 1])  # a first block (pages only), so the next one asks for whole parts
            reader = threading.Thread(target=lambda: got.update(ds.read(keys)), daemon=True)
            reader.start()
            reader.join(30)
            waited = reader.is_alive()
        finally:
            release.set()
        reader.join()
    assert not waited, "the block waited for the landed copy to be checked and named"
    check_batch({"key": np.array(keys), **got})


# Blocks opened ahead (docs/design.md §9, *Blocks that complete during the download*): a later
# block's rows are registered before an earlier block's parts are asked for.
AHEAD_KEYS = [5, 22, PER_SHARD + 18, 2 * PER_SHARD + 25]  # in the parts of KEYS, not on their pages


def _rows_for(payload: Any, n: int) -> tuple[np.ndarray, Any]:
    """Rows for ``n`` records of ``payload`` and the destination that reads into them."""
    from shardkit.formats.reader import Destination

    out = np.zeros((n, *payload.record.shape), dtype=payload.dtype)
    return out, Destination.rows_of(out, n)


def _opened_ahead(ds: Dataset) -> tuple[Any, np.ndarray, Any]:
    """``ds``'s payload with its download started (the background held back) and read as a later
    block (whole parts asked), and the rows and destination of a block of :data:`AHEAD_KEYS` it
    opened ahead of its read."""
    payload: Any = ds.payload
    payload.schedule(iter([]))
    payload._blocks_read = 1
    out, dest = _rows_for(payload, len(AHEAD_KEYS))
    assert payload.deliver_ahead(np.array(AHEAD_KEYS), dest)
    return payload, out, dest


def test_a_block_opened_ahead_gets_its_records_from_an_earlier_blocks_parts(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block registered ahead of its read gets every record that lands in the parts an earlier
    block asked for from their chunks: none of its records is read back from the copy."""
    reads = _copy_reads(monkeypatch)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        payload, out, dest = _opened_ahead(ds)
        check_batch({"key": np.array(KEYS), **ds.read(KEYS)})  # its parts hold the block's records too
        before = len(reads)
        payload.read_into(np.array(AHEAD_KEYS), dest)
        st = payload.prefetcher.stats
    np.testing.assert_array_equal(out, encode(np.array(AHEAD_KEYS), SHAPE))
    assert not [w for w, _ in reads[before:] if "local cache copy" in w], reads[before:]
    assert st.delivered_bytes == (len(KEYS) + len(AHEAD_KEYS)) * REC


def test_a_block_opened_ahead_is_planned_once(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan a block opened ahead was registered with is the one its read uses: planned once."""
    from shardkit.formats.reader import PayloadArray

    planned: list[list[int]] = []
    real = PayloadArray._plan

    def counted(self: Any, keys: np.ndarray, *args: Any) -> Any:
        planned.append(keys.tolist())
        return real(self, keys, *args)

    monkeypatch.setattr(PayloadArray, "_plan", counted)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        payload, out, dest = _opened_ahead(ds)
        check_batch({"key": np.array(KEYS), **ds.read(KEYS)})
        payload.read_into(np.array(AHEAD_KEYS), dest)
    np.testing.assert_array_equal(out, encode(np.array(AHEAD_KEYS), SHAPE))
    assert planned.count(sorted(AHEAD_KEYS)) == 1, planned


def test_a_block_opened_ahead_reads_back_none_of_its_delivered_records_once_the_copies_are_complete(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks after the download read complete copies through the local engine; a block opened
    ahead still takes its deliveries over there: what the parts delivered is not read again."""
    reads = _copy_reads(monkeypatch)
    every = list(range(N))  # every record's parts asked for
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        payload, out, dest = _opened_ahead(ds)
        check_batch({"key": np.array(every), **ds.read(every)})
        # The pages no block asks for (each shard's index) come with the background order, held
        # back by the fixture until here: let it go so the copies complete, as in any run.
        assert prefetch.hold_background is not None
        prefetch.hold_background.set()
        deadline = time.monotonic() + 30
        while any(payload._cached_fd(i) is None for i in range(N // PER_SHARD)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(payload._cached_fd(i) is not None for i in range(N // PER_SHARD))
        before = len(reads)
        payload.read_into(np.array(AHEAD_KEYS), dest)
        st = payload.prefetcher.stats
    np.testing.assert_array_equal(out, encode(np.array(AHEAD_KEYS), SHAPE))
    assert st.delivered_bytes >= len(AHEAD_KEYS) * REC
    assert not [w for w, _ in reads[before:] if "local cache copy" in w], reads[before:]


def test_a_retried_part_delivers_its_last_response_to_both_blocks(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a block read and one opened ahead registered on the same parts, each part's first
    response hands over wrong bytes and is fetched again: both blocks hold the second response's
    bytes, each record counted delivered once."""
    seen = _garbage_first(monkeypatch)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        payload, out, dest = _opened_ahead(ds)
        got = ds.read(KEYS)
        payload.read_into(np.array(AHEAD_KEYS), dest)
        st = payload.prefetcher.stats
    assert seen
    np.testing.assert_array_equal(got["image"], encode(np.array(KEYS), SHAPE))
    np.testing.assert_array_equal(out, encode(np.array(AHEAD_KEYS), SHAPE))
    assert st.delivered_bytes == (len(KEYS) + len(AHEAD_KEYS)) * REC


def test_a_failed_part_delivers_nothing_to_a_block_opened_ahead(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part that copied its bytes into both blocks' rows and then fails delivers nothing to
    either: the block read raises, the block opened ahead counts no record delivered, and its
    registrations are taken back when the reader closes (no copy into its rows after)."""
    deliveries = _deliveries(monkeypatch)

    def copied_then_failed(r: ByteRange, sink: Callable[[int, memoryview], None]) -> None:
        sink(r.start, memoryview(b"\xff" * r.nbytes))
        raise StoreError(f"{r.key}: the server went away (injected)")

    _streams(monkeypatch, copied_then_failed)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        _opened_ahead(ds)
        ahead = list(deliveries)
        with pytest.raises(StoreError, match="injected"):
            ds.read(KEYS)
        assert ahead and len(deliveries) > len(ahead)
    assert not any(any(d.delivered()) for d in deliveries), [(d.which, d.got, d.fill.index) for d in deliveries]
    assert not any(d in d.fill.deliveries for d in deliveries)


def test_the_sampler_opens_blocks_ahead_while_it_downloads(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold epoch with a cache: the reader opens the blocks after the one it reads that the batch
    pool has room for, so the records the earlier blocks' parts bring are copied into their rows
    (more bytes delivered from the parts than when each block registers at its own read, fewer
    read back), and the batches are the local run's."""
    from shardkit.readers import TieredSampler
    from shardkit.tiers import pipeline

    started: list[prefetch.ShardPrefetcher] = []
    init = prefetch.ShardPrefetcher.__init__

    def watched(self: prefetch.ShardPrefetcher, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        started.append(self)

    monkeypatch.setattr(prefetch.ShardPrefetcher, "__init__", watched)
    real_open = pipeline.Pipeline._open_ahead

    def open_when_free(self: Any, opening: Any, i: int) -> None:
        # Blocks are opened only with buffers free at that moment, so how many are opened depends on
        # how far the consumer got: give it a moment (bounded: a buffer the block carries into the
        # next one never frees) so the test does not depend on the machine's load.
        deadline = time.monotonic() + 1.0
        before = len(opening.blocks)
        real_open(self, opening, i)
        while opening.active and len(opening.blocks) == before and time.monotonic() < deadline:
            time.sleep(0.005)
            real_open(self, opening, i)

    monkeypatch.setattr(pipeline.Pipeline, "_open_ahead", open_when_free)
    kw: dict[str, Any] = {"batch_size": 4, "epochs": 1, "seed": 3, "ram_size": "40records", "static_cache": 0}
    expected = list(TieredSampler(str(tmp_path / "ds"), **kw))
    real = pipeline.Pipeline._opens_ahead
    delivered: dict[bool, int] = {}
    for ahead in (False, True):
        monkeypatch.setattr(pipeline.Pipeline, "_opens_ahead", real if ahead else (lambda self: False))
        (tmp_path / str(ahead)).mkdir()
        got = list(TieredSampler(url, cache_dir=_cache(tmp_path / str(ahead)), **kw))
        for a, b in zip(got, expected, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        delivered[ahead] = started[-1].stats.delivered_bytes
    assert delivered[True] > delivered[False], delivered
