"""A remote dataset whose shards download in many small parts, for the tests of the cold download path,
and the cache directory those tests give it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardkit.stores import cache as cache_mod
from shardkit.stores import prefetch
from tests.helpers.datasets import upload
from tests.helpers.sampler_data import make_dataset

N, PER_SHARD, SHAPE = 120, 40, (64, 64, 4)  # 16 KiB records (SCATTER_MIN_BYTES): shards of 10 pages and an index
RECORDS_PER_PART = 8  # parts of two 64 KiB pages


def small_parts_url(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """The dataset uploaded to ``s3`` under ``name``, with downloads patched to parts of 8 records."""
    monkeypatch.setattr(prefetch, "PART_BYTES", 2 * cache_mod.PAGE_BYTES)
    local = make_dataset(tmp_path / "ds", N, records_per_shard=PER_SHARD, shape=SHAPE)
    return upload(local, s3.url(f"{name}-{tmp_path.name}"))


def cache_dir(tmp_path: Path) -> Path:
    """``tmp_path/cache``, made if missing."""
    d = tmp_path / "cache"
    d.mkdir(exist_ok=True)
    return d
