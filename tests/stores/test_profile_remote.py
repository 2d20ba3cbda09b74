"""``shardkit profile`` on a dataset in an object store (SeaweedFS). Lives with the store tests: the
object store's I/O thread is process-wide, and the sampler's lifecycle tests count threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardkit.profiling import profile, report_lines
from tests.helpers.datasets import upload
from tests.helpers.profiling import check_profile
from tests.helpers.sampler_data import make_dataset


def test_profile_remote_dataset(tmp_path: Path, s3: Any) -> None:
    ds = make_dataset(tmp_path / "ds", 30, records_per_shard=6)
    url = upload(ds, s3.url("profile-ds"))
    prof = profile(url, step_time="1ms", batch_size=4, ram_size="10records")
    check_profile(prof, 30, 2)
    assert prof.remote and prof.rates.page_cache_bytes == 0
    assert prof.phases["ingest-cold"].storage_calls > 0
    assert "page cache" not in "\n".join(report_lines(prof)).split("rates")[1].split("\n")[0]
