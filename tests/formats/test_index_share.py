"""The default records per shard keep a shard's index a small share of the shard (#32 item 5).

A shard's index has one 16-byte entry per slot, filled or not (zarr's sharding codec), so the
capacity chosen by default bounds what an index costs, above all in a partly filled last shard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats.spec import DEFAULT_SHARD_BYTES, INDEX_SHARE, index_nbytes, records_per_shard_for


def _write(path: Path, record: FieldSpec, n: int, **kw: int) -> int:
    """Write ``n`` records of ``record`` with the default capacity; returns the bytes on disk."""
    values = np.arange(n * record.nbytes, dtype=np.uint64).astype(np.uint8).reshape(n, *record.shape)
    with DatasetWriter(path, kind="test", payload="image", record=record, **kw) as w:
        for start in range(0, n, 997):
            w.write({"image": values[start : start + 997]})
    with open_dataset(path) as ds:
        assert ds.num_records == n
        assert np.array_equal(ds.read(np.arange(n))["image"], values)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("record_nbytes", [1, 16, 1000, 3072, 150528, 1 << 20])
def test_default_capacity_bounds_the_index_by_the_shard_size(record_nbytes: int) -> None:
    for shard_bytes in (1 << 20, DEFAULT_SHARD_BYTES, 1 << 30):
        slots = records_per_shard_for(record_nbytes, shard_bytes)
        assert index_nbytes(slots) - 4 <= max(16, shard_bytes // INDEX_SHARE)
        assert slots * record_nbytes <= max(record_nbytes, shard_bytes)


def test_four_tiny_records_make_a_small_dataset(tmp_path: Path) -> None:
    # 4 records of 16 B took 128 MiB: 8 M slots of index at the default shard size.
    total = _write(tmp_path / "ds", FieldSpec((16,), "uint8"), 4)
    assert total < 1_100_000 + 4 * 16 + 8192


@pytest.mark.parametrize("shape", [(32, 32, 3), (16000,), (64, 64, 3)])
def test_index_is_under_one_percent_of_a_dataset_of_small_records(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """Three full shards and a partly filled last one (whose index is full size)."""
    record = FieldSpec(shape, "uint8")
    shard_bytes = 1 << 20
    per_shard = records_per_shard_for(record.nbytes, shard_bytes)
    n = 3 * per_shard + 1
    _write(tmp_path / "ds", record, n, shard_bytes=shard_bytes)
    with open_dataset(tmp_path / "ds") as ds:
        shards = ds.meta.shards
        assert len(shards) == 4
        index = len(shards) * index_nbytes(ds.meta.records_per_shard)
        assert sum(s.nbytes for s in shards) == n * record.nbytes + index
    assert index / (n * record.nbytes + index) < 0.01
