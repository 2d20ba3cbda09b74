"""Faults between the sampler and a real S3 server: every epoch either finishes with exactly the
right bytes or stops with an error naming the object and byte range; never wrong data.

Injected: 5xx and throttling answers, connection resets, bodies cut short, answers shorter than the
range (a lying server), flipped bytes (compressed records carry checksums), a server paused with
SIGSTOP, and a server killed with SIGKILL and restarted mid-epoch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import CorruptShardError, StoreError
from shardkit.formats import open_dataset
from shardkit.readers import TieredSampler
from shardkit.stores import StoreOptions
from tests.helpers.datasets import make_records, upload, write_dataset
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.sampler_data import check_batch, make_dataset


@pytest.fixture
def proxied(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Build a fault proxy in front of the session server and point the environment at it."""
    made: list[FaultProxy] = []

    def make(plan: Any, **kw: Any) -> FaultProxy:
        proxy = FaultProxy(s3.port, plan, **kw)
        made.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return proxy

    yield make
    for p in made:
        p.close()


def _epoch(url: str, n: int, **kw: Any) -> list[dict[str, np.ndarray]]:
    s = TieredSampler(url, batch_size=4, epochs=1, seed=4, ram_size="6records", cache_dir=None, **kw)
    return list(s)


@pytest.mark.parametrize("fault", ["503", "500", "reset", "short", "lie"])
def test_transient_faults_are_retried(s3: Any, proxied: Any, tmp_path: Path, fault: str) -> None:
    """Every other data read fails; the epoch still delivers exactly the local dataset's batches."""
    n = 40
    local = make_dataset(tmp_path / "ds", n, records_per_shard=6)
    url = upload(local, s3.url("ds"))
    expected = _epoch(str(local), n)
    proxy = proxied(lambda i: fault if i % 2 == 0 else "ok")
    got = _epoch(url, n)
    assert proxy.done[fault] >= 3
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        check_batch(a)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_retry_budget_then_a_clear_error(s3: Any, proxied: Any, tmp_path: Path) -> None:
    """A server that keeps failing: after the budget, the error names the object and byte range."""
    url = upload(write_dataset(tmp_path / "ds", make_records(20)), s3.url("ds"))
    armed = threading.Event()
    proxy = proxied(lambda i: "503" if armed.is_set() else "ok")
    opts = StoreOptions(retries=3, retry_seconds=30, backoff_initial=0.01, backoff_max=0.05)
    with open_dataset(url, store_options=opts) as ds, pytest.raises(StoreError) as err:
        armed.set()
        ds.payload.read([12])
    message = str(err.value)
    # The first request for shard 1 is its tail (the identity check against tail_crc32c, before any of
    # its records is served): the last 4 KiB of its records, here all 360 bytes of them.
    assert f"{url}/image/c/1/0/0/0: bytes 0-359" in message and "503" in message and "after 4 attempts in" in message
    assert proxy.done["503"] == 4  # the first try and three retries
    # Through the sampler, as one line from the CLI's point of view: the same named error.
    with pytest.raises(StoreError, match=rf"{url}/\S+: bytes \d+-\d+: failed after"):
        _epoch(url, 20, remote_retry="1s")


def test_timeouts_are_retried(s3: Any, proxied: Any, tmp_path: Path) -> None:
    records = make_records(20)
    url = upload(write_dataset(tmp_path / "ds", records), s3.url("ds"))
    proxy = proxied(lambda i: "slow" if i == 0 else "ok", slow_seconds=3.0)
    with open_dataset(url, store_options=StoreOptions(timeout=1.0)) as ds:
        np.testing.assert_array_equal(ds.payload.read([3, 4]), records[[3, 4]])
        assert proxy.done["slow"] == 1 and ds.store.counters.retries >= 1  # type: ignore[attr-defined]


def test_flipped_bytes_in_compressed_records_are_caught(s3: Any, proxied: Any, tmp_path: Path) -> None:
    """Record bytes changed on the way (same length) are refused by the records' checksums (zstd
    frames); they are never delivered."""
    url = upload(write_dataset(tmp_path / "ds", make_records(20), compression="zstd"), s3.url("ds"))
    armed = threading.Event()
    proxied(lambda i: "flip" if armed.is_set() else "ok")
    with open_dataset(url) as ds:
        ds.payload.index(1)  # the shard index itself is read before the fault starts
        armed.set()
        with pytest.raises(CorruptShardError, match="does not decode"):
            ds.payload.read(np.arange(10, 20))
    # An index changed on the way fails its crc32c (recorded in the metadata) instead.
    with pytest.raises(CorruptShardError, match="crc32c"), open_dataset(url) as ds:
        ds.payload.read(np.arange(10, 20))


def test_server_paused_mid_epoch(private_seaweed: Any, tmp_path: Path) -> None:
    """SIGSTOP for a few seconds in the middle of an epoch, then SIGCONT: the epoch finishes."""
    n = 60
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=5), private_seaweed.url("ds"))
    s = TieredSampler(url, batch_size=4, epochs=1, seed=8, ram_size="6records", cache_dir=None)
    keys: list[np.ndarray] = []
    for i, batch in enumerate(s):
        keys.append(check_batch(batch))
        if i == 3:
            private_seaweed.pause()
            threading.Timer(3.0, private_seaweed.resume).start()
    assert sorted(np.concatenate(keys).tolist()) == list(range(n))


def test_server_killed_and_restarted_mid_epoch(private_seaweed: Any, tmp_path: Path) -> None:
    """SIGKILL in the middle of an epoch, restart on the same ports and data a moment later: the
    retries ride it out and the epoch delivers every record exactly once, bytes intact."""
    n = 60
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=5), private_seaweed.url("ds"))
    s = TieredSampler(url, batch_size=4, epochs=2, seed=8, ram_size="6records", cache_dir=None)
    keys: list[np.ndarray] = []
    restarted = threading.Event()
    failed: list[BaseException] = []

    def restart() -> None:
        time.sleep(1.0)
        try:
            private_seaweed.restart()
        except BaseException as exc:  # shown as the cause below, with the server's log
            failed.append(exc)
        restarted.set()

    try:
        for i, batch in enumerate(s):
            keys.append(check_batch(batch))
            if i == 3:
                private_seaweed.kill()
                threading.Thread(target=restart, daemon=True).start()
    except StoreError as exc:
        if failed:  # the server did not come back: say so rather than only what the sampler saw
            raise AssertionError(f"the restart failed: {failed[0]}") from exc
        raise
    # The epoch can end before the restart's own readiness probe (a PUT and a GET) returns: the
    # sampler's retries get through as soon as the server answers reads. Wait for it, bounded.
    assert restarted.wait(120) and not failed, failed
    flat = np.concatenate(keys).reshape(2, n)
    assert all(sorted(row.tolist()) == list(range(n)) for row in flat)


def test_server_gone_for_good(private_seaweed: Any, tmp_path: Path) -> None:
    """A server that does not come back: the sampler stops with an error naming the object and range."""
    url = upload(make_dataset(tmp_path / "ds", 30, records_per_shard=5), private_seaweed.url("ds"))
    s = TieredSampler(url, batch_size=4, epochs=1, seed=8, ram_size="6records", remote_retry="2s", cache_dir=None)
    it = iter(s)
    check_batch(next(it))
    private_seaweed.kill()
    with pytest.raises(StoreError, match=r"/ds/(image/c/\d+/0/0/0: bytes \d+-\d+|zarr.json)"):
        for batch in it:
            check_batch(batch)
