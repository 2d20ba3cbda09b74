"""Whole-shard prefetch into the local cache (issue 11's cold-epoch miss): one whole-object GET per
shard instead of many ranged reads, cached shards read with no request, damaged or changed objects
refused with an error naming them, the budget kept, the order unchanged, and no partial file under
a final name after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import CorruptShardError, ObjectChangedError
from shardkit.formats import Dataset
from shardkit.formats.reader import ReadStats
from shardkit.order.schedule import epoch_permutation
from shardkit.readers import TieredSampler
from shardkit.stores import open_store
from tests.helpers.datasets import upload
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.sampler_data import check_batch, make_dataset

N, PER_SHARD = 60, 7
SHARDS = -(-N // PER_SHARD)


@pytest.fixture
def remote(s3: Any, tmp_path: Path) -> str:
    return upload(make_dataset(tmp_path / "ds", N, records_per_shard=PER_SHARD), s3.url("pf"))


@pytest.fixture
def proxy(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    p = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    yield p
    p.close()


def _final_copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("shard-*") if p.is_file() and not p.name.endswith(".part"))


def _wait_all(ds: Dataset) -> None:
    pf = ds.payload.prefetcher  # type: ignore[attr-defined]
    assert pf is not None
    for i in range(len(pf.items)):
        pf.wait(i)


def _payload_gets(proxy: Any) -> list[tuple[str, bool]]:
    return [(path, ranged) for path, ranged in proxy.gets if "/image/c/" in path]


def test_prefetch_issues_whole_object_gets(remote: str, proxy: Any, tmp_path: Path) -> None:
    """Reading one record starts the download of every shard, one GET without a range each."""
    cache = tmp_path / "cache"
    cache.mkdir()
    stats = ReadStats()
    with Dataset(remote, cache_dir=cache, stats=stats) as ds:
        ds.read([5])
        _wait_all(ds)
        sizes = [info.nbytes for info in ds.payload.shards]
    whole = [path for path, ranged in _payload_gets(proxy) if not ranged]
    assert len(whole) == SHARDS and len(set(whole)) == SHARDS  # each shard object once, whole
    assert len(_final_copies(cache)) == SHARDS
    # Storage bytes: the dataset once (plus at most the one record read before its shard arrived).
    assert sum(sizes) <= stats.bytes_read <= sum(sizes) + 64


def test_cached_shard_read_issues_no_ranged_request(remote: str, proxy: Any, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with Dataset(remote, cache_dir=cache) as ds:
        ds.read([0])
        _wait_all(ds)
        before = list(proxy.gets)
        calls = ds.stats.read_calls
        batch = ds.read(list(range(0, N, 3)))
        assert proxy.gets == before and ds.stats.read_calls == calls  # no request of any kind
        check_batch({"key": np.arange(0, N, 3), **batch})


def test_sampler_waits_for_prefetched_shards(remote: str, proxy: Any, tmp_path: Path) -> None:
    """Through the sampler: a cold epoch's payload comes from whole-object GETs alone (blocks wait
    for the shards being prefetched), and the order is exactly the epoch permutation."""
    cache = tmp_path / "cache"
    cache.mkdir()
    s = TieredSampler(remote, batch_size=4, epochs=2, seed=11, ram_size="12records", cache_dir=cache)
    keys = np.concatenate([check_batch(b) for b in s])
    np.testing.assert_array_equal(keys, np.concatenate([epoch_permutation(11, e, N) for e in (0, 1)]))
    gets = _payload_gets(proxy)
    assert not any(ranged for _, ranged in gets)
    assert len(gets) == SHARDS


def test_budget_is_never_exceeded(remote: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    shard_bytes = open_store(remote).head("image/c/0/0/0/0").size
    budget = 3 * shard_bytes + shard_bytes // 2
    s = TieredSampler(remote, batch_size=4, epochs=1, seed=3, ram_size="12records", cache_dir=cache,
                      cache_size=budget)
    seen = 0
    for b in s:
        seen += check_batch(b).size
        assert sum(p.stat().st_size for p in cache.rglob("shard-*") if p.is_file()) <= budget
    assert seen == N
    assert len(_final_copies(cache)) == 3


def test_corrupt_object_is_refused(remote: str, tmp_path: Path) -> None:
    """An object whose bytes no longer match the recorded crc32c (same size) is refused by name."""
    store = open_store(remote)
    key = "image/c/2/0/0/0"
    raw = bytearray(store.get(key))
    raw[3] ^= 0xFF
    store.put(key, bytes(raw))
    cache = tmp_path / "cache"
    cache.mkdir()
    def left() -> bool:
        return any(".part" in p.name or p.name == "shard-00000002" for p in cache.rglob("*"))

    with Dataset(remote, cache_dir=cache) as ds:
        with pytest.raises(CorruptShardError, match=r"image/c/2/0/0/0.*crc32c"):
            ds.read([2 * PER_SHARD])
        # The refused copy is deleted once the shard's parts still in flight have ended (bounded wait,
        # before the dataset closes: a copy closed mid-part is kept for the next filler).
        for _ in range(1000):
            if not left():
                break
            threading.Event().wait(0.01)
    assert not left()


def test_changed_object_is_refused(remote: str, tmp_path: Path) -> None:
    """A shard whose ETag is not the one pinned for it (it changed on the server) is an
    ObjectChangedError naming it, for the download as for ranged reads."""
    store = open_store(remote)
    key = "image/c/4/0/0/0"
    size = store.head(key).size
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ObjectChangedError, match="image/c/4/0/0/0"):
            store.download(key, fd, size=size, etag='"not-the-etag"')
    finally:
        os.close(fd)
    cache = tmp_path / "cache"
    cache.mkdir()
    with Dataset(remote, cache_dir=cache) as ds:
        ds.payload._etags[4] = '"an-older-version"'  # type: ignore[attr-defined]  # as if pinned earlier
        with pytest.raises(ObjectChangedError, match="image/c/4/0/0/0"):
            ds.read([4 * PER_SHARD])
            _wait_all(ds)
    assert not ({p.name for p in cache.rglob("*")} & {"shard-00000004", "shard-00000004.part"})


_KILLED = """
import sys
from shardkit.readers import TieredSampler
s = TieredSampler(sys.argv[1], batch_size=4, epochs=1, seed=2, ram_size="12records", cache_dir=sys.argv[2])
for b in s:
    pass
"""


def test_killed_mid_prefetch_leaves_no_partial_final_file(s3: Any, tmp_path: Path) -> None:
    """A reader killed (SIGKILL) while its downloads are half-way leaves only ``.part`` files, no
    file under a final name; a new run finishes the epoch with every record right, and its copies
    are the exact shards."""
    local = make_dataset(tmp_path / "big", 400, records_per_shard=50, shape=(64, 64, 4))  # 8 shards of ~800 KB
    url = upload(local, s3.url("killed"))
    slow = FaultProxy(s3.port, lambda n: "ok", stall_whole=30.0)  # the kill lands mid-download
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "AWS_ENDPOINT_URL": slow.endpoint}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, url, str(cache)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(p.name.endswith(".part") for p in cache.rglob("*")):
            time.sleep(0.01)
        assert any(p.name.endswith(".part") for p in cache.rglob("*")), "no download started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        slow.close()
    assert not _final_copies(cache)  # every download was stalled half-way: nothing complete
    assert any(p.name.endswith(".part") for p in cache.rglob("*"))
    s = TieredSampler(url, batch_size=4, epochs=1, seed=2, ram_size="12records", cache_dir=cache)
    keys = np.concatenate([check_batch(b) for b in s])
    np.testing.assert_array_equal(keys, epoch_permutation(2, 0, 400))  # the dead run's copies: no page marked, all fetched again
    for copy in _final_copies(cache):
        i = int(copy.name.split("-")[1])
        assert copy.read_bytes() == (local / "image" / "c" / str(i) / "0" / "0" / "0").read_bytes()
