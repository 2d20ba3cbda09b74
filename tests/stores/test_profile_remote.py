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
    prof = profile(url, step_time="1ms", batch_size=4, ram_size="10records", cache_dir=None)
    check_profile(prof, 30, 2)
    assert prof.remote and prof.rates.page_cache_bytes == 0
    assert prof.phases["ingest-cold"].storage_calls > 0
    # Bytes and requests fetched per epoch, in the phases and the report.
    cold = prof.phases["ingest-cold"]
    assert len(cold.epoch_storage_bytes) == len(cold.epoch_storage_calls) == 1
    assert cold.epoch_storage_calls[0] == cold.storage_calls and cold.epoch_storage_bytes[0] == cold.storage_bytes
    text = "\n".join(report_lines(prof))
    assert "storage per epoch (bytes, requests, x the dataset's" in text
    assert "ingest-cold" in text.split("storage per epoch")[1] and f"in {cold.storage_calls} requests (" in text
    assert "page cache" not in "\n".join(report_lines(prof)).split("rates")[1].split("\n")[0]
