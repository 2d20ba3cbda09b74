"""A later sampler of a remote dataset this process opened before (the next pass of a DataLoader
worker) opens it from the remembered documents after one HEAD of the root document, which runs
while its first block is read (issue 32 item 1); a dataset replaced between passes is still refused.
Requests are counted at the object-store client."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import ChecksumError, SamplerError
from shardkit.formats import Dataset
from shardkit.readers import TieredSampler, identity
from shardkit.readers.sources import MixedIdentity, as_source
from shardkit.stores import objectstore, open_store
from shardkit.tiers import pipeline
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import encode, make_dataset

N = 64


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Requests the object-store client makes, by kind and by kind and key (``"get zarr.json"``; a
    fetch of no ranges makes none). ``get`` is one ``get_tagged``, counted there."""
    counts: collections.Counter[str] = collections.Counter()
    for method, name in (("head", "head"), ("get_tagged", "get"), ("download", "download"), ("list", "list")):
        original = getattr(objectstore.ObjectStore, method)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            if args and isinstance(args[0], str):
                counts[f"{_name} {args[0]}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(objectstore.ObjectStore, method, counted)
    start_fetch = objectstore.ObjectStore.start_fetch

    def fetch(self: Any, ranges: Any) -> Any:
        if ranges:
            counts["ranged get"] += len(ranges)
        return start_fetch(self, ranges)

    monkeypatch.setattr(objectstore.ObjectStore, "start_fetch", fetch)
    return counts


def _keys(sampler: TieredSampler, first: int = 0) -> Iterator[np.ndarray]:
    """The keys of each batch, each record checked (record ``i`` encodes ``first + i``)."""
    try:
        for batch in sampler:
            np.testing.assert_array_equal(batch["image"], encode(batch["key"] + first))
            yield batch["key"].copy()
    finally:
        sampler.close()


def test_a_later_pass_asks_the_store_one_head(s3: Any, tmp_path: Path, requests: collections.Counter[str]) -> None:
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    (tmp_path / "cache").mkdir()
    source = as_source(url)  # as a DataLoader worker gets it: made once, in the main process
    options = {"batch_size": 8, "epochs": 1, "cache_dir": tmp_path / "cache"}
    # Kept alive, it keeps the node-shared fields, as the DataLoader's main process does for its workers.
    holder = TieredSampler(source, seed=1, **options)
    first = np.concatenate(list(_keys(holder)))
    assert requests["get zarr.json"] == 1  # the root document (identity, metadata)
    assert requests["ranged get"] >= 1  # the array documents (and the shards)
    requests.clear()
    second = np.concatenate(list(_keys(TieredSampler(source, seed=1, start_epoch=1, **options))))
    assert dict(requests) == {"head": 1, "head zarr.json": 1}  # shards from the cache, documents remembered
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(N))
    assert first.tolist() != second.tolist()
    del holder


def test_a_first_open_reads_the_root_document_with_one_get(
    s3: Any, tmp_path: Path, requests: collections.Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making the source and its first sampler asks for ``zarr.json`` once: its bytes give the
    fingerprint and the metadata, the same answer the ETag (no HEAD before, no second GET)."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    # No periodic re-check inside this test, however slowly it runs (those are HEADs by design).
    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 1e9)
    requests.clear()
    source = as_source(url)
    assert {k: v for k, v in requests.items() if k.endswith("zarr.json")} == {"get zarr.json": 1}
    keys = np.concatenate(list(_keys(TieredSampler(source, seed=1, batch_size=8, epochs=1, cache_dir=None))))
    assert sorted(keys.tolist()) == list(range(N))
    root = {k: v for k, v in requests.items() if k.endswith(" zarr.json") and " image/" not in k}
    assert root == {"get zarr.json": 1}
    assert requests["get image/zarr.json"] == 0  # fetched with the fields' documents (next test)


def test_a_first_open_fetches_the_array_documents_in_one_round(
    s3: Any, tmp_path: Path, requests: collections.Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the root document, the payload array's document is fetched with the fields' in one
    round of concurrent requests (the payload reader asked for it a round trip after them), each
    checked by the digest the root document records."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    rounds: list[list[str]] = []
    start_fetch = objectstore.ObjectStore.start_fetch

    def fetch(self: Any, ranges: Any) -> Any:
        rounds.append(sorted(r.key for r in ranges))
        return start_fetch(self, ranges)

    monkeypatch.setattr(objectstore.ObjectStore, "start_fetch", fetch)
    with Dataset(url) as ds:
        assert ds.payload.document["shape"][0] == N
    assert rounds[0] == ["image/zarr.json", "label/zarr.json", "pair/zarr.json"], rounds
    assert requests["get image/zarr.json"] == 0

    store = open_store(url)  # a payload document that does not match its digest is refused
    raw = store.get("image/zarr.json")
    store.put("image/zarr.json", raw[:-1] + (b" " if raw[-1:] != b" " else b"\n"))
    with pytest.raises(ChecksumError):
        Dataset(url)


@pytest.mark.parametrize("cache", [True, False])
def test_a_dataset_replaced_between_passes_is_refused(s3: Any, tmp_path: Path, cache: bool) -> None:
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    (tmp_path / "cache").mkdir()
    source = as_source(url)
    options: dict[str, Any] = {"batch_size": 8, "epochs": 1, "seed": 1,
                               "cache_dir": tmp_path / "cache" if cache else None}
    assert len(np.concatenate(list(_keys(TieredSampler(source, **options))))) == N
    upload(make_dataset(tmp_path / "other", N, records_per_shard=8, first=1000), url)  # same shape, other records

    served: list[np.ndarray] = []
    with pytest.raises(SamplerError, match=r"replaced|changed"):
        served.extend(_keys(TieredSampler(source, **options)))
    assert served == []
    # A source made after the replacement reads the new dataset (nothing stale was remembered).
    keys = np.concatenate(list(_keys(TieredSampler(as_source(url), **options), first=1000)))
    assert sorted(keys.tolist()) == list(range(N))


def test_the_identity_check_runs_while_the_first_block_is_read(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HEAD of a reopened dataset is held until the first block's ranged reads have started: had
    the sampler waited for it before reading, the hold would run out and the check would fail."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    source = as_source(url)
    options: dict[str, Any] = {"batch_size": 8, "epochs": 1, "seed": 1, "cache_dir": None}
    assert len(np.concatenate(list(_keys(TieredSampler(source, **options))))) == N

    reading = threading.Event()
    held: list[bool] = []
    start_fetch, head = objectstore.ObjectStore.start_fetch, objectstore.ObjectStore.head

    def fetch(self: Any, ranges: Any) -> Any:
        if any(r.key.startswith("image/") for r in ranges):  # records, not the fields loaded at build
            reading.set()
        return start_fetch(self, ranges)

    def held_head(self: Any, key: str) -> Any:
        held.append(reading.wait(30))
        if not held[-1]:
            raise AssertionError("the identity check waited for the first block's reads, or they for it")
        return head(self, key)

    monkeypatch.setattr(objectstore.ObjectStore, "start_fetch", fetch)
    monkeypatch.setattr(objectstore.ObjectStore, "head", held_head)
    keys = np.concatenate(list(_keys(TieredSampler(source, **options))))
    assert sorted(keys.tolist()) == list(range(N))
    assert held == [True]


def test_a_due_check_runs_while_the_block_is_read(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: collections.Counter[str]
) -> None:
    """Every identity check is due (no pause between them): each runs in a thread of its own while
    a block is read, never on the thread that reads the blocks, where its round trip stalled the
    reading (a warm epoch's block is read in less than a round trip). Every block is still checked."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    (tmp_path / "cache").mkdir()
    source = as_source(url)
    options: dict[str, Any] = {"batch_size": 8, "epochs": 1, "seed": 1, "cache_dir": tmp_path / "cache",
                               "ram_size": 16 * 8 * 4}  # blocks of a few batches: several blocks
    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 0.0)
    threads: list[str] = []
    head = objectstore.ObjectStore.head

    def watched(self: Any, key: str) -> Any:
        threads.append(threading.current_thread().name)
        return head(self, key)

    monkeypatch.setattr(objectstore.ObjectStore, "head", watched)
    blocks: list[int] = []
    read_block = pipeline.Pipeline._read_block

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks.append(1)
        return read_block(self, *args, **kwargs)

    monkeypatch.setattr(pipeline.Pipeline, "_read_block", counted)
    keys = np.concatenate(list(_keys(TieredSampler(source, **options))))
    assert sorted(keys.tolist()) == list(range(N))
    assert len(blocks) >= 2
    assert len(threads) >= len(blocks)  # each block's read covered by a check
    assert set(threads) == {"shardkit-identity-check"}, threads


def _hold_heads(monkeypatch: pytest.MonkeyPatch, release: threading.Event,
                seconds: float) -> tuple[threading.Event, list[bool]]:
    """Every HEAD of the store waits for ``release`` (at most ``seconds``) before it is asked: the
    event set once one is waiting, and the outcome of each wait (True: released)."""
    asked = threading.Event()
    released: list[bool] = []
    head = objectstore.ObjectStore.head

    def held(self: Any, key: str) -> Any:
        asked.set()
        released.append(release.wait(seconds))
        return head(self, key)

    monkeypatch.setattr(objectstore.ObjectStore, "head", held)
    return asked, released


def test_a_half_due_check_does_not_hold_the_reader(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a read, a check half due starts in the background; the check after the read does not
    wait for it while the last success still covers the read, and takes its outcome once it is done."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    ident = identity.DatasetIdentity.of(url)
    ident._live.checked -= 0.75 * identity.REMOTE_CHECK_SECONDS  # checked three quarters of the pause ago
    release = threading.Event()
    asked, released = _hold_heads(monkeypatch, release, 30)
    ident.check(wait=False)  # before a read: starts the check, does not ask here
    ident.check()  # after the read: the last success still covers it
    assert asked.wait(30)  # the HEAD is under way in its thread, held
    ahead = ident._live.ahead
    assert ahead is not None
    release.set()
    ahead.result(30)
    ident.check()  # takes its outcome
    assert released == [True]
    assert ident.fresh()


def _settle_while_held(
    monkeypatch: pytest.MonkeyPatch, start: Callable[[], identity.DatasetIdentity]
) -> tuple[bool, list[bool]]:
    """``start()`` begins a check, whose HEAD is held, of the identity it returns; its
    :meth:`~identity.DatasetIdentity.settle` runs in a thread: whether that returned while the HEAD
    was still held, and the HEAD's releases seen when it returned."""
    release, settled = threading.Event(), threading.Event()
    seen: list[bool] = []
    asked, released = _hold_heads(monkeypatch, release, 60)
    ident = start()
    assert asked.wait(30)

    def settle() -> None:
        ident.settle()
        seen.extend(released)
        settled.set()

    thread = threading.Thread(target=settle, daemon=True)
    thread.start()
    early = settled.wait(10)  # only a settle that waits for the held HEAD takes this long
    release.set()
    thread.join(30)
    return early, seen


def test_the_first_batch_does_not_wait_for_a_check_a_recent_success_covers(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold first block that lasts past half the pause starts the next check; the first batch
    (settle) is covered by the success before it and does not wait for that round trip. A reader
    whose first check has not succeeded yet still waits for it."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    ident = identity.DatasetIdentity.of(url)
    ident._live.checked -= 0.75 * identity.REMOTE_CHECK_SECONDS  # checked three quarters of the pause ago

    def begin_read() -> identity.DatasetIdentity:
        ident.check(wait=False)  # before the block's read: the half-due check starts
        return ident

    early, seen = _settle_while_held(monkeypatch, begin_read)
    assert early and seen == []
    ident.check()  # the check's outcome is taken by the next waiting check
    assert ident.fresh()

    early, seen = _settle_while_held(monkeypatch, ident.reopened)  # a later reader: its first check is held
    assert not early and seen == [True]


def test_a_replacement_found_in_the_background_is_raised(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    ident = identity.DatasetIdentity.of(url)
    upload(make_dataset(tmp_path / "other", N, records_per_shard=8, first=1000), url)
    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 0.0)
    ident.check(wait=False)
    with pytest.raises(SamplerError, match=r"replaced|changed"):
        ident.check()


def test_a_check_since_the_read_began_covers_a_long_read(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: collections.Counter[str]
) -> None:
    """A read that took longer than the pause between checks (a cold first block) is covered by a
    check that succeeded after it began: the check after it asks nothing more. One that began after
    the last success is checked again."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    ident = identity.DatasetIdentity.of(url)
    requests.clear()
    now = time.monotonic()
    pause = identity.REMOTE_CHECK_SECONDS
    ident._live.read_began, ident._live.checked = now - 1.5 * pause, now - 1.4 * pause  # checked while it read
    ident.check()
    assert requests["head"] == 0
    ident._live.read_began, ident._live.checked = now - 1.4 * pause, now - 1.5 * pause  # checked before it began
    ident.check()
    assert requests["head"] == 1


def test_a_long_read_gets_its_check_while_it_runs(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: collections.Counter[str]
) -> None:
    """A read that begins just after a check lasts past half the pause (a cold first block): its
    check starts while it runs, and the check after it asks nothing more. One that ends sooner
    cancels the check it did not need."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 0.2)
    ident = identity.DatasetIdentity.of(url)
    asked = threading.Event()
    head = objectstore.ObjectStore.head

    def watched(self: Any, key: str) -> Any:
        out = head(self, key)
        asked.set()
        return out

    monkeypatch.setattr(objectstore.ObjectStore, "head", watched)
    requests.clear()
    ident.check(wait=False)  # a read begins
    assert asked.wait(30)  # ... and, while it lasts, its check is asked in the background
    ident.check()  # the read ends: covered
    assert requests["head"] == 1

    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 3600.0)  # its check would start half an hour on
    ident._live.checked = time.monotonic()  # just checked
    ident.check(wait=False)
    ident.check()  # a short read: its delayed check is cancelled, nothing asked
    ident.settle()
    assert requests["head"] == 1
    assert ident._live.ahead is None


def test_a_closing_run_gives_up_its_delayed_check(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: collections.Counter[str]
) -> None:
    """A run closed while a delayed check waits to start cancels it: no request reaches the store
    after the run ended (the check's thread would otherwise ask once it is due)."""
    url = upload(make_dataset(tmp_path / "ds", N, records_per_shard=8), s3.url("ds"))
    monkeypatch.setattr(identity, "REMOTE_CHECK_SECONDS", 3600.0)
    ident = identity.DatasetIdentity.of(url)
    ident._live.checked = time.monotonic()  # just checked: the next check is delayed half an hour
    requests.clear()
    ident.check(wait=False)  # a read begins, and is cut short by close
    ahead = ident._live.ahead
    assert ahead is not None and not ahead.done()
    MixedIdentity((ident,)).cancel()
    assert ahead.cancelled() and ident._live.ahead is None
    assert requests["head"] == 0

    cancelled: list[MixedIdentity] = []
    monkeypatch.setattr(MixedIdentity, "cancel", lambda self: cancelled.append(self))
    with TieredSampler(url, tiers="ram", ram_size="8records", batch_size=4, epochs=1, seed=0) as s:
        next(iter(s))
    assert cancelled  # the run's shutdown gave up what its identity had pending
