"""A remote dataset without ``cache_dir``: a node-shared cache in the temp dir by default, its budget
from free space, ranged reads when opted out or out of space, and ranged reads that fetch about the
epoch's bytes once (docs/design.md §9)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from shardkit.readers import SamplerOptions, TieredSampler
from shardkit.readers.sources import CACHE_DIR_ENV, MIN_FREE_BYTES, mix, plan_remote_cache
from shardkit.stores.cache import footprint
from tests.helpers.cli import run_main
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import check_batch, make_dataset

GiB = 1 << 30


class _Usage(NamedTuple):
    total: int
    used: int
    free: int


def _fake_disk(monkeypatch: pytest.MonkeyPatch, total: int, free: int) -> list[str]:
    """``shutil.disk_usage`` reports ``total`` and ``free`` bytes; returns the paths it was asked about."""
    asked: list[str] = []

    def usage(path: str | os.PathLike[str]) -> _Usage:
        asked.append(os.fspath(path))
        return _Usage(total, total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return asked


def _cached_shards(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"shardkit-cache-{os.geteuid()}/*/shard-*") if p.is_file())


@pytest.fixture
def url(s3: Any, tmp_path: Path) -> str:
    return upload(make_dataset(tmp_path / "ds", 40, records_per_shard=8), s3.url("ds"))


def _dataset_bytes(url: str) -> tuple[int, int]:
    """The cache budget the dataset's shards take (:func:`footprint`: each copy and, while it is
    being filled, its progress map) and its largest shard's."""
    meta = mix([(url, 1)]).metas[0]
    sizes = [footprint(s.nbytes) for s in meta.shards]
    return sum(sizes), max(sizes)


def test_default_cache_in_the_temp_dir_and_the_plan_says_so(url: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """No cache_dir: the shards are cached under the default directory (the temp dir, here the
    session's via SHARDKIT_CACHE_DIR), the plan names it and its budget, and a second run reads them
    locally without a request for a record."""
    where = Path(os.environ[CACHE_DIR_ENV])
    asked = _fake_disk(monkeypatch, 100 * GiB, 50 * GiB)
    nbytes, _ = _dataset_bytes(url)
    assert run_main("sample", url, "--batch-size", "4", "--ram-size", "10records", "--seed", "1") == 0
    out = capsys.readouterr().out
    root = where / f"shardkit-cache-{os.geteuid()}"
    assert f"remote cache {root}, budget " in out and "the whole dataset fits" in out
    assert asked == [str(where)]
    assert len(_cached_shards(where)) == 5
    s = TieredSampler(url, batch_size=4, ram_size="10records", seed=1)
    assert s.remote_cache.directory == where and s.remote_cache.budget == nbytes
    assert s.options.cache_dir == where and s.options.cache_size == nbytes  # what its workers get
    assert sorted(np.concatenate([check_batch(b) for b in s]).tolist()) == list(range(40))
    assert s.stats.disk.read_calls == 0 and s.stats.disk.bytes_read == 0  # no request: every record read locally
    assert s.stats.remote_cache.bytes_read >= 40 * 16


def test_default_budget_from_free_space(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset's bytes when they fit leaving 10% of the disk and 1 GiB free; else what fits
    (copies already cached count as room); else no cache, and the plan says why."""
    nbytes, largest = _dataset_bytes(url)
    source = mix([(url, 1)])
    opts = SamplerOptions()
    _fake_disk(monkeypatch, 100 * GiB, 50 * GiB)
    plan = plan_remote_cache(source, opts)
    assert (plan.kind, plan.budget) == ("default", nbytes)
    # 10% of a 100 GiB disk is the larger reserve: 10 GiB + 3 shards of room.
    _fake_disk(monkeypatch, 100 * GiB, 10 * GiB + 3 * largest)
    plan = plan_remote_cache(source, opts)
    assert (plan.kind, plan.budget) == ("default", 3 * largest) and "what fits" in plan.describe()[0]
    # On a 4 GiB disk the 1 GiB floor is the larger reserve.
    _fake_disk(monkeypatch, 4 * GiB, MIN_FREE_BYTES + 2 * largest)
    assert plan_remote_cache(source, opts).budget == 2 * largest
    # Less room than one shard: no cache, ranged reads, and the reason in the plan.
    _fake_disk(monkeypatch, 4 * GiB, MIN_FREE_BYTES + largest - 1)
    plan = plan_remote_cache(source, opts)
    assert (plan.kind, plan.directory, plan.budget) == ("no space", None, None)
    assert "ranged reads" in plan.describe()[0] and "keeps 1.0 GiB free" in plan.describe()[0]
    s = TieredSampler(url, batch_size=4, ram_size="10records")
    assert s.options.cache_dir is None and s.remote_cache.kind == "no space"
    assert sorted(np.concatenate([check_batch(b) for b in s]).tolist()) == list(range(40))
    assert not _cached_shards(Path(os.environ[CACHE_DIR_ENV]))
    # Copies already in the cache are room: the same free space after caching the whole dataset.
    _fake_disk(monkeypatch, 100 * GiB, 50 * GiB)
    list(TieredSampler(url, batch_size=4, ram_size="10records"))
    _fake_disk(monkeypatch, 100 * GiB, 10 * GiB + nbytes - 1)
    assert plan_remote_cache(source, opts).budget == nbytes
    # An explicit cache_size is the default cache's budget as it is; an explicit directory has no limit.
    assert plan_remote_cache(source, SamplerOptions(cache_size="1MiB")).budget == 1 << 20
    explicit = plan_remote_cache(source, SamplerOptions(cache_dir=Path(os.environ[CACHE_DIR_ENV])))
    assert explicit.kind == "explicit" and "budget no limit" in explicit.describe()[0]
    assert "(set by cache_dir)" in explicit.describe()[0]


def test_opting_out_gives_ranged_reads(url: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """cache_dir=None in Python, --cache-dir none on the command line: no cache, ranged reads."""
    _fake_disk(monkeypatch, 100 * GiB, 50 * GiB)
    assert SamplerOptions(cache_dir="none").cache_dir is None and SamplerOptions().cache_dir == "auto"
    s = TieredSampler(url, batch_size=4, ram_size="10records", cache_dir=None)
    assert s.remote_cache.kind == "off" and s.remote_cache.directory is None
    assert sorted(np.concatenate([check_batch(b) for b in s]).tolist()) == list(range(40))
    assert s.stats.disk.records == 40 and s.stats.remote_cache.read_calls == 0
    assert run_main("sample", url, "--batch-size", "4", "--ram-size", "10records", "--cache-dir", "none") == 0
    out = capsys.readouterr().out
    assert "remote cache none: ranged reads of each block's records, every epoch (--cache-dir is none)" in out
    assert "remote/epoch 0: " in out and " requests" in out.split("remote/epoch 0: ")[1].splitlines()[0]
    assert not _cached_shards(Path(os.environ[CACHE_DIR_ENV]))


def test_ranged_epochs_fetch_the_dataset_about_once(s3: Any, tmp_path: Path) -> None:
    """Without a cache, sparse blocks (ram_size a quarter of the dataset) fetch at most 1.1x the
    epoch's bytes (each shard's identity check included), and the stats count bytes and requests
    of every epoch."""
    n, shape = 64, (64, 64, 4)  # 16 KiB records, 256 KiB shards
    url = upload(make_dataset(tmp_path / "ds", n, records_per_shard=16, shape=shape), s3.url("sparse"))
    rec = int(np.prod(shape))
    s = TieredSampler(url, batch_size=4, epochs=3, seed=5, ram_size=f"{n // 4}records", static_cache=0, cache_dir=None)
    assert sum(b["key"].size for b in s) == 3 * n
    st = s.stats
    assert sorted(st.disk_bytes_by_epoch) == sorted(st.disk_requests_by_epoch) == [0, 1, 2]
    for e in range(3):
        assert n * rec <= st.disk_bytes_by_epoch[e] <= 1.1 * n * rec, (e, st.disk_bytes_by_epoch[e] / (n * rec))
        assert st.disk_requests_by_epoch[e] > 0
    assert sum(st.disk_requests_by_epoch.values()) == st.disk.read_calls
    assert sum(st.disk_bytes_by_epoch.values()) == st.disk.bytes_read
