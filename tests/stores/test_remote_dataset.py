"""Datasets in an object store, read through every entry point: the same records, fields, orders and
checks as the local copy; requests and bytes of the remote tier counted per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import (
    ChecksumError,
    DatasetNotFoundError,
    IncompleteDatasetError,
    MissingShardError,
    TruncatedShardError,
    UnsafePathError,
)
from shardkit.formats import open_dataset, verify
from shardkit.readers import TieredSampler
from shardkit.stores import open_store
from tests.helpers.datasets import edit_attributes, flip_byte, make_records, upload, write_dataset
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import check_batch, make_dataset


@pytest.fixture(params=[None, "zstd"])
def pair(request: pytest.FixtureRequest, s3: Any, tmp_path: Path) -> tuple[Path, str, np.ndarray]:
    """A local dataset and its copy in the bucket."""
    records = make_records(57)
    local = write_dataset(tmp_path / "ds", records, records_per_shard=10, compression=request.param)
    return local, upload(local, s3.url("ds")), records


def test_open_read_fields_info(pair: tuple[Path, str, np.ndarray]) -> None:
    local, url, records = pair
    with open_dataset(local) as a, open_dataset(url) as b:
        assert b.path == url and isinstance(b.path, str)
        keys = np.random.default_rng(1).permutation(57)[:40]
        np.testing.assert_array_equal(b.payload.read(keys), records[keys])
        for name in a.fields:
            np.testing.assert_array_equal(a.fields[name], b.fields[name])
        ia, ib = a.info(), b.info()
        assert ib.pop("path") == url and ib.pop("remote") is True
        ia.pop("path"), ia.pop("remote")
        assert ia == ib
        assert b[5]["image"].tolist() == records[5].tolist()


def test_remote_reads_are_coalesced_ranges(s3: Any, tmp_path: Path) -> None:
    """One request per shard and block for dense keys; no index requests for uncompressed shards
    (the recorded crc32c fixes them); every response scattered into the right row."""
    records = make_records(60)
    url = upload(write_dataset(tmp_path / "ds", records, records_per_shard=20), s3.url("ds"))
    with open_dataset(url, remote_gap_bytes=1 << 20) as ds:
        ds.stats.trace = []
        keys = np.array([59, 0, 21, 3, 40, 45, 22])
        np.testing.assert_array_equal(ds.payload.read(keys), records[keys])
        # Per shard: one GET of its tail (the identity check, tail_crc32c: here the shard's whole 720 bytes
        # of records, at most TAIL_SAMPLE_NBYTES), once per reader, and one of its records (gaps are far
        # below a remote_gap_bytes of 1 MiB).
        assert ds.stats.read_calls == 3 + 3
        tails, runs = ds.stats.trace[:3], sorted(ds.stats.trace[3:])  # the tails come first
        assert sorted(t[1:] for t in tails) == [(0, 20 * 36)] * 3
        assert [t[1] for t in runs] == [0, 21 * 36 - 20 * 36, 40 * 36 - 40 * 36]
        ds.payload.read(keys)
        assert ds.stats.read_calls == 6 + 3  # the tails are checked once
    with open_dataset(url, remote_gap_bytes=0) as ds:
        ds.payload.read(keys)
        assert ds.stats.read_calls == 3 + 6  # 0,3 | 21,22 | 40 | 45 | 59 : adjacent records still share one
        assert ds.stats.bytes_read == 3 * 20 * 36 + 7 * 36


def test_verify_remote(pair: tuple[Path, str, np.ndarray], tmp_path: Path) -> None:
    local, url, _ = pair
    report = verify(url)
    assert report.ok and report.shards_checked == 6 and report.bytes_checked > 0
    assert verify(url, quick=True).ok
    # A damaged copy of one shard: full verify names it; quick verify does not read records.
    shard = next(p for p in sorted((local / "image").rglob("*")) if p.is_file())
    rel = shard.relative_to(local).as_posix()
    damaged = tmp_path / "damaged"
    damaged.write_bytes(shard.read_bytes())
    flip_byte(damaged, 3)
    open_store(url).put_file(rel, damaged)
    report = verify(url)
    assert not report.ok and [p.path for p in report.problems] == [f"{url}/{rel}"]
    assert "crc32c" in report.problems[0].message
    open_store(url).delete(rel)
    report = verify(url, quick=True)
    assert [p.path for p in report.problems] == [f"{url}/{rel}"] and "not found" in report.problems[0].message


def test_wrong_size_shard_never_read_as_data(s3: Any, tmp_path: Path) -> None:
    records = make_records(30)
    local = write_dataset(tmp_path / "ds", records, records_per_shard=10)
    url = upload(local, s3.url("ds"))
    rel = "image/c/1/0/0/0"
    data = (local / rel).read_bytes()
    open_store(url).put(rel, data[:-40])  # shorter than recorded
    with open_dataset(url) as ds, pytest.raises(TruncatedShardError, match=rf"{rel}.*should be {len(data)} bytes"):
        ds.payload.read(np.arange(30))
    open_store(url).delete(rel)
    with open_dataset(url) as ds, pytest.raises(MissingShardError) as err:
        ds.payload.read([15])
    assert rel in str(err.value) or "not found" in str(err.value)


def test_damaged_metadata_and_documents(s3: Any, tmp_path: Path) -> None:
    local = write_dataset(tmp_path / "ds", make_records(20))
    edit_attributes(local, lambda a: a["labels"].__setitem__("label", ["x", "y", "z"]), fix_checksum=False)
    url = upload_raw(local, s3.url("bad"))
    with pytest.raises(ChecksumError, match=r"zarr\.json"):
        open_dataset(url)
    with pytest.raises(DatasetNotFoundError, match="nothing stored"):
        open_dataset(s3.url("never-written"))
    store = open_store(s3.url("partial"))
    store.put("image/zarr.json", b"{}")
    with pytest.raises(IncompleteDatasetError, match="interrupted"):
        open_dataset(store.url)


def test_metadata_paths_stay_inside_for_urls(s3: Any, tmp_path: Path) -> None:
    """A shard path or field name from the metadata that would leave the dataset prefix is refused
    before anything is requested."""
    local = write_dataset(tmp_path / "ds", make_records(20))
    edit_attributes(local, lambda a: a["shards"][1].__setitem__("path", "../other/image/c/1/0/0/0"))
    with pytest.raises(UnsafePathError):
        open_dataset(upload_raw(local, s3.url("esc")))
    local2 = write_dataset(tmp_path / "ds2", make_records(20))
    edit_attributes(local2, lambda a: a.__setitem__("fields", {"../x": a["fields"]["label"]}))
    with pytest.raises(UnsafePathError):
        open_dataset(upload_raw(local2, s3.url("esc2")))


def upload_raw(local: Path, url: str) -> str:
    """Upload files as they are (even a dataset that does not open), root document last."""
    store = open_store(url)
    files = sorted(p for p in local.rglob("*") if p.is_file() and ".shardkit" not in p.parts[-2])
    for p in sorted(files, key=lambda p: p == local / "zarr.json"):
        store.put_file(p.relative_to(local).as_posix(), p)
    return url


# ---------------------------------------------------------------------- the sampler


@pytest.mark.parametrize("stack", [dict(tiers="ram", ram_size="8records"),
                                   dict(tiers="ram,ssd", ram_size="6records", ssd_size="16records")])
def test_remote_sample_equals_local(s3: Any, tmp_path: Path, stack: dict[str, str]) -> None:
    """Same seed: the remote sample's keys and bytes are exactly the local sample's."""
    local = make_dataset(tmp_path / "ds", 41, records_per_shard=5)
    url = upload(local, s3.url("ds"))
    runs = []
    for where in (local, url):
        s = TieredSampler(where, batch_size=4, epochs=2, seed=9, ssd_dir=tmp_path, cache_dir=None, **stack)  # type: ignore[arg-type]
        batches = list(s)
        for b in batches:
            check_batch(b)
        runs.append(batches)
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_each_record_fetched_once_per_epoch(s3: Any, tmp_path: Path) -> None:
    """With no gap coalescing every record's bytes are requested exactly once per epoch (the
    trace proves it); with the default threshold the extra bytes are counted, never re-delivered."""
    n, rec = 60, 16
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=7), s3.url("ds"))
    s = TieredSampler(url, batch_size=5, epochs=3, seed=2, ram_size="10records", remote_gap_bytes=0, cache_dir=None)
    s.stats.disk.trace = []
    assert sum(b["key"].size for b in s) == 3 * n
    # The first request of each shard is its identity check (the tail, checked against tail_crc32c
    # before any record is served: here the shard's whole records, which are smaller than the sample),
    # once per reader; records are requested by the other requests, exactly once per epoch.
    per_record: dict[tuple[str, int], int] = {}
    tails: dict[str, tuple[int, int]] = {}
    for path, off, nbytes in s.stats.disk.trace:
        if path not in tails:
            tails[path] = (off, nbytes)
            continue
        assert nbytes % rec == 0
        for j in range(nbytes // rec):
            per_record[(path, off + j * rec)] = per_record.get((path, off + j * rec), 0) + 1
    assert len(per_record) == n and set(per_record.values()) == {3}
    shard_sizes = [min(7, n - 7 * i) * rec for i in range(len(tails))]
    assert sorted(tails.values(), key=lambda t: -t[1]) == [(0, size) for size in shard_sizes]
    assert s.stats.disk.bytes_read == 3 * n * rec + n * rec
    dense = TieredSampler(url, batch_size=5, epochs=3, seed=2, ram_size="10records", remote_gap_bytes="1MiB",
                          cache_dir=None)
    assert sum(b["key"].size for b in dense) == 3 * n
    assert dense.stats.disk.read_calls < s.stats.disk.read_calls  # coalesced into fewer requests


@pytest.mark.parametrize("stack", ["ram", "ram,ssd"])
def test_uniform_through_remote_tier(s3: Any, tmp_path: Path, stack: str) -> None:
    """Item x position chi-square (scaled by (N-1)/N, (N-1)^2 dof) over 600 epochs read from the
    server, at alpha = 1e-3; and the default options (the whole dataset in one RAM block)."""
    n = 8
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=3), s3.url("ds"))
    sizes = dict(ram_size="3records") if stack == "ram" else dict(ram_size="2records", ssd_size="5records")
    s = TieredSampler(url, tiers=stack, batch_size=3, epochs=600, seed=21, ssd_dir=tmp_path, cache_dir=None, **sizes)  # type: ignore[arg-type]
    orders = np.concatenate([check_batch(b) for b in s]).reshape(600, n)
    assert (np.sort(orders, axis=1) == np.arange(n)).all()
    assert item_position_pvalue(orders) > ALPHA
    assert s.stats.disk.records == 600 * n
    default = TieredSampler(url, batch_size=3, epochs=300, seed=22, cache_dir=None)
    orders = np.concatenate([check_batch(b) for b in default]).reshape(300, n)
    assert item_position_pvalue(orders) > ALPHA


def test_http_dataset(s3: Any, tmp_path: Path) -> None:
    """A dataset behind plain HTTP (anonymous reads): info, sample and verify work read-only."""
    local = make_dataset(tmp_path / "ds", 12, records_per_shard=5)
    url = upload(local, s3.url("ds"))
    http = f"{s3.endpoint}/{url[len('s3://'):]}"
    assert verify(http).ok
    s = TieredSampler(http, batch_size=4, epochs=1, seed=1, cache_dir=None)
    assert sorted(np.concatenate([check_batch(b) for b in s]).tolist()) == list(range(12))


def test_http_dataset_with_a_signed_query(s3: Any, tmp_path: Path) -> None:
    """A base URL with a query (a shared-access signature) keeps the query after every key, in the
    requests and in messages, where its values are hidden."""
    local = make_dataset(tmp_path / "ds", 12, records_per_shard=5)
    url = upload(local, s3.url("ds"))
    http = f"{s3.endpoint}/{url[len('s3://'):]}?sig=S3CR3T"
    s = TieredSampler(http, batch_size=4, epochs=1, seed=1)
    assert sorted(np.concatenate([check_batch(b) for b in s]).tolist()) == list(range(12))
    store = open_store(http)
    assert store.describe("a/zarr.json") == f"{s3.endpoint}/{url[len('s3://'):]}/a/zarr.json?sig=***"


# ---------------------------------------------------------------------- the CLI


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, check=False)


def test_cli_info_verify_sample_on_urls(s3: Any, tmp_path: Path) -> None:
    local = make_dataset(tmp_path / "ds", 30, records_per_shard=7)
    url = upload(local, s3.url("ds"))
    info = _cli("info", url, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["records"] == 30 and json.loads(info.stdout)["path"] == url
    ok = _cli("verify", url)
    assert ok.returncode == 0 and "OK, 5 shards" in ok.stdout
    order = tmp_path / "order.npy"
    out = _cli("sample", url, "--batch-size", "4", "--epochs", "2", "--seed", "3", "--ram-size", "8records",
               "--cache-dir", "none", "--order-out", str(order))
    assert out.returncode == 0, out.stderr
    assert "remote" in out.stdout and "requests" in out.stdout
    keys = np.load(order)
    assert keys.shape == (2, 30) and (np.sort(keys, axis=1) == np.arange(30)).all()
    local_order = tmp_path / "local.npy"
    assert _cli("sample", str(local), "--batch-size", "4", "--epochs", "2", "--seed", "3", "--ram-size", "8records",
                "--order-out", str(local_order)).returncode == 0
    np.testing.assert_array_equal(np.load(local_order), keys)
    # Errors are one line naming the URL, never a traceback.
    missing = _cli("info", s3.url("nothing-here"))
    assert missing.returncode == 1 and "nothing stored" in missing.stderr and "Traceback" not in missing.stderr
    denied = _cli("info", url, env={"AWS_SECRET_ACCESS_KEY": "wrong"})
    assert denied.returncode == 1 and "access denied" in denied.stderr and "Traceback" not in denied.stderr


def test_dataset_replaced_mid_run_stops_the_sampler(s3: Any, tmp_path: Path) -> None:
    """Another dataset uploaded over the URL while a sampler reads it: the sampler stops with an
    error (the shards' pinned ETags, or the root document's identity), never mixing the two."""
    from shardkit.errors import CorruptShardError, SamplerError, StoreError

    url = upload(make_dataset(tmp_path / "a", 40, records_per_shard=5), s3.url("ds"))
    other = make_dataset(tmp_path / "b", 40, records_per_shard=5, shape=(4, 4, 2))
    s = TieredSampler(url, batch_size=4, epochs=3, seed=1, ram_size="6records", cache_dir=None)
    it = iter(s)
    check_batch(next(it))
    upload(other, url)
    # (a shard first read after the swap has another size than the metadata: CorruptShardError)
    with pytest.raises((SamplerError, StoreError, CorruptShardError)) as err:
        for batch in it:
            check_batch(batch)  # every batch delivered before the error is the old dataset's
    assert url in str(err.value)
