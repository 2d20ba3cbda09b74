"""A valid shard that is not the dataset's own is refused when it is opened (issue 31).

Two uncompressed shards of the same layout have the same size and byte-identical indexes, so a shard
copied from another dataset, or two swapped shards, passed every check a reader makes on open and
were served as data; only a full ``verify`` saw them. The metadata now records the crc32c of the end
of each shard's records (``tail_crc32c``), read with the index in the same request.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ChecksumError
from shardkit.formats import Dataset, verify
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES
from shardkit.readers import TieredSampler
from tests.helpers.datasets import edit_attributes, make_records, write_dataset

SHARD_0, SHARD_1 = "image/c/0/0/0/0", "image/c/1/0/0/0"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_shard_copied_from_another_dataset_is_refused(tmp_path: Path, compression: str | None) -> None:
    ours = write_dataset(tmp_path / "ours", make_records(25, seed=1), records_per_shard=10, compression=compression)
    other = write_dataset(tmp_path / "other", make_records(25, seed=2), records_per_shard=10, compression="zstd"
                          if compression else None)  # fmt: skip
    other_bytes = (other / SHARD_1).read_bytes()
    if compression is None:  # the case size and index cannot see: same size, identical index
        assert len(other_bytes) == (ours / SHARD_1).stat().st_size
        assert other_bytes[-164:] == (ours / SHARD_1).read_bytes()[-164:]
    shutil.copyfile(other / SHARD_1, ours / SHARD_1)
    with Dataset(ours) as ds:
        np.testing.assert_array_equal(ds.payload.read([3]), make_records(25, seed=1)[[3]])  # other shards still read
        with pytest.raises((ChecksumError,)) as caught:
            ds.payload.read([13])
    if compression is None:
        assert "not the dataset's shard" in str(caught.value) and "shard 1 (records 10-19)" in str(caught.value)
    report = verify(ours, quick=True)
    assert [p.start for p in report.problems] == [10]


def test_swapped_shards_are_refused_by_the_reader_the_sampler_and_verify(tmp_path: Path) -> None:
    ds_path = write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10)
    a, b = (ds_path / SHARD_0).read_bytes(), (ds_path / SHARD_1).read_bytes()
    assert len(a) == len(b) and a[-164:] == b[-164:]  # same size, same index: indistinguishable before
    (ds_path / SHARD_0).write_bytes(b)
    (ds_path / SHARD_1).write_bytes(a)
    with Dataset(ds_path) as ds, pytest.raises(ChecksumError, match=r"shard 0 \(records 0-9\).*not the dataset's shard"):
        ds.payload.read([0])
    sampler = TieredSampler(ds_path, ram_size="30records", batch_size=5, epochs=1, seed=0)
    with pytest.raises(ChecksumError, match="not the dataset's shard"):
        for _ in sampler:
            pass
    sampler.close()
    assert [p.start for p in verify(ds_path, quick=True).problems] == [0, 10]


def test_the_tail_checked_is_the_end_of_the_records(tmp_path: Path) -> None:
    """A change to the end of the last record is caught on open; the sample is bounded, so the
    first record of a large shard is outside it (that is ``verify``'s job)."""
    records = make_records(8, shape=(1024,))  # 8 KiB of records: twice the sample
    ds_path = write_dataset(tmp_path / "ds", records, records_per_shard=8)
    shard = ds_path / "image/c/0/0"
    raw = bytearray(shard.read_bytes())
    data_end = 8 * 1024
    raw[data_end - 1] ^= 0x01
    shard.write_bytes(bytes(raw))
    with Dataset(ds_path) as ds, pytest.raises(ChecksumError, match=f"the last {TAIL_SAMPLE_NBYTES} bytes"):
        ds.payload.read([0])
    raw[data_end - 1] ^= 0x01
    raw[0] ^= 0x01  # outside the sample: not seen on open, seen by a full verify
    shard.write_bytes(bytes(raw))
    with Dataset(ds_path) as ds:
        ds.payload.read([0])
    assert [p.start for p in verify(ds_path).problems] == [0]


def test_datasets_without_a_recorded_tail_still_open(tmp_path: Path) -> None:
    """``tail_crc32c`` is optional: a dataset written before it existed reads as before."""
    records = make_records(25)
    ds_path = write_dataset(tmp_path / "ds", records, records_per_shard=10)

    def drop(attrs: dict) -> None:
        for shard in attrs["shards"]:
            assert "tail_crc32c" in shard
            del shard["tail_crc32c"]

    edit_attributes(ds_path, drop)
    with Dataset(ds_path) as ds:
        assert all(info.tail_crc32c is None for info in ds.meta.shards)
        np.testing.assert_array_equal(ds.payload.read(np.arange(25)), records)
    assert verify(ds_path).ok
