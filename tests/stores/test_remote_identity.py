"""Shard identity for a dataset in an object store (issue 31): a shard swapped with another one, or
copied from another dataset, is refused by the sampler before any of its records is served.

Locally the tail (``tail_crc32c``) comes with the index. Remotely the index of an uncompressed shard is
not fetched (the metadata fixes it), so the tail is fetched alone, once per shard, before the shard's
first ranged read; where the index is fetched (compressed shards) the tail comes in the same request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import ChecksumError
from shardkit.formats import Dataset, verify
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES
from shardkit.readers import TieredSampler
from shardkit.stores import open_store
from tests.helpers.datasets import make_records, upload, write_dataset

PER_SHARD = 200  # 200 records of 36 bytes: more records than the tail sample covers
SHARD_0, SHARD_1 = "image/c/0/0/0/0", "image/c/1/0/0/0"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_swapped_shards_in_the_store_are_refused_by_the_sampler(s3: Any, tmp_path: Path, compression: str | None) -> None:
    records = make_records(3 * PER_SHARD, seed=5)
    local = write_dataset(tmp_path / "ds", records, records_per_shard=PER_SHARD, compression=compression)
    assert PER_SHARD * records[0].nbytes > TAIL_SAMPLE_NBYTES
    url = upload(local, s3.url("ds"))
    store = open_store(url)
    a, b = (local / SHARD_0).read_bytes(), (local / SHARD_1).read_bytes()
    if compression is None:  # the case size and index cannot tell apart
        assert len(a) == len(b) and a[-(PER_SHARD * 16 + 4) :] == b[-(PER_SHARD * 16 + 4) :]
    store.put(SHARD_0, b)
    store.put(SHARD_1, a)

    with Dataset(url) as ds:
        np.testing.assert_array_equal(ds.payload.read([2 * PER_SHARD + 3]), records[[2 * PER_SHARD + 3]])
        with pytest.raises(ChecksumError, match=r"image/c/1/0/0/0: shard 1 \(records 200-399\).*not the dataset's shard"):
            ds.payload.read([PER_SHARD + 3])  # the first record, far from the tail
    sampler = TieredSampler(url, ram_size="100records", batch_size=10, epochs=1, seed=0, cache_dir=None)
    served: list[np.ndarray] = []
    try:
        with pytest.raises(ChecksumError, match="not the dataset's shard"):
            for batch in sampler:
                served.append(batch["key"].copy())
    finally:
        sampler.close()
    keys = np.concatenate(served) if served else np.zeros(0, np.int64)
    assert not np.any(keys < 2 * PER_SHARD)  # no record of a swapped shard was served
    assert [p.start for p in verify(url, quick=True).problems] == [0, PER_SHARD]


def test_the_tail_is_fetched_once_per_shard(s3: Any, tmp_path: Path) -> None:
    """Uncompressed: one small GET of the tail per shard at its first ranged read, none after;
    compressed: no request more (the tail comes with the index, in the same request)."""
    records = make_records(3 * PER_SHARD, seed=5)
    isize = PER_SHARD * 16 + 4
    for compression, first_per_shard in [(None, TAIL_SAMPLE_NBYTES), ("zstd", TAIL_SAMPLE_NBYTES + isize)]:
        url = upload(write_dataset(tmp_path / str(compression), records, records_per_shard=PER_SHARD,
                                   compression=compression), s3.url(str(compression)))  # fmt: skip
        with Dataset(url) as ds:
            ds.stats.trace = []
            keys = np.arange(0, 3 * PER_SHARD, 50)
            np.testing.assert_array_equal(ds.payload.read(keys), records[keys])
            first = ds.stats.read_calls
            np.testing.assert_array_equal(ds.payload.read(keys), records[keys])
            assert first - (ds.stats.read_calls - first) == 3  # once per shard: the second read, records only
            assert sorted(t[2] for t in ds.stats.trace[:3]) == [first_per_shard] * 3
