"""An empty index slot inside a shard's records is an error for the readers and ``verify`` alike (issue 31).

zarr reads a chunk never written as the fill value, so a shard index whose slot was emptied (offset and
nbytes all-ones) used to give zeros in the sampler; the one index check both use now refuses it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import CorruptIndexError
from shardkit.formats import Dataset, verify
from shardkit.formats.index import crc32c_of
from tests.helpers.datasets import edit_attributes, make_records, rewrite_shard_index, write_dataset

_EMPTY = np.uint64(2**64 - 1)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_an_emptied_slot_is_refused_by_readers_and_verify(tmp_path: Path, compression: str | None) -> None:
    ds = write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10, compression=compression)
    shard = ds / "image/c/1/0/0/0"

    def empty_slot(table: np.ndarray) -> None:
        table[3] = _EMPTY

    rewrite_shard_index(shard, 10, empty_slot)
    raw = shard.read_bytes()
    index_crc = crc32c_of(raw[len(raw) - 10 * 16 - 4 : -4])

    def record(attrs: dict) -> None:  # a metadata that agrees with the edited file: only the slot is wrong
        attrs["shards"][1]["index_crc32c"] = index_crc
        attrs["shards"][1]["crc32c"] = crc32c_of(raw)

    edit_attributes(ds, record)
    with Dataset(ds) as d, pytest.raises(CorruptIndexError, match=r"index slot 3 \(record 13\) is empty"):
        d.read([13])
    report = verify(ds)
    assert [p.start for p in report.problems] == [10]
    assert "index slot 3 (record 13) is empty" in report.problems[0].message
