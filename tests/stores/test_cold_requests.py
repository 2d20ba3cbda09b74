"""Requests of a cold epoch with a cache (issue 32): the first block's asks are merged across gaps
of up to a quarter part, so the gaps do not become requests of their own later, and every byte is
still fetched once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardkit.readers import TieredSampler
from shardkit.stores import cache as cache_mod
from shardkit.stores import prefetch
from tests.helpers.datasets import upload
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.sampler_data import make_dataset
from tests.helpers.small_parts import cache_dir

N, PER_SHARD, SHAPE = 2000, 500, (64, 64, 4)  # 16 KiB records, four shards of four parts
PART_PAGES = 32  # 2 MiB parts: a quarter part (8 pages) is wider than the old rule's 4-page gaps


def test_cold_epoch_merges_the_first_blocks_asks_across_small_gaps(s3: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A first block of 100 uniform records lies about 5 pages apart in its shards: asked for
    record by record (gaps of at most 4 pages merged), the epoch made 51 requests here, the gaps
    left behind fetched one by one; merged across a quarter part, 31. Bytes: the dataset once."""
    monkeypatch.setattr(prefetch, "PART_BYTES", PART_PAGES * cache_mod.PAGE_BYTES)
    assert prefetch.demand_gap_pages() == PART_PAGES // 4
    # The background at its full width from the start: the count is the merging's alone (the opening
    # leaves more of a small first block to its own asks; it is tested in test_cold_schedule.py).
    monkeypatch.setattr(prefetch, "OPENING_SECONDS", 0.0)
    local = make_dataset(tmp_path / "ds", N, records_per_shard=PER_SHARD, shape=SHAPE)
    url = upload(local, s3.url(f"requests-{tmp_path.name}"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        s = TieredSampler(url, cache_dir=cache_dir(tmp_path), batch_size=8, epochs=1, seed=5, ram_size="100records")
        assert sum(len(b["key"]) for b in s) == N
        requests = [path for path, _ in proxy.gets if "/image/c/" in path]
    finally:
        proxy.close()
    total = sum(p.stat().st_size for p in (local / "image" / "c").rglob("*") if p.is_file())
    assert s.stats.disk.bytes_read == total  # every byte once: the merged gaps are not fetched again
    assert len(requests) <= 36, len(requests)
