"""zarr-python reads what shardkit writes, and shardkit reads what zarr-python writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
import zarr.codecs

from shardkit import errors
from shardkit.formats import PayloadArray, open_dataset
from tests.helpers.datasets import make_records, write_dataset


@pytest.mark.parametrize("codec", [None, "zstd", "gzip", "blosc-lz4"])
def test_zarr_reads_shardkit(tmp_path: Path, codec: str | None) -> None:
    recs = make_records(33, (5, 4, 3))
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=8, compression=codec)
    group = zarr.open_group(path, mode="r")
    assert set(group.array_keys()) == {"image", "label"}
    image = group["image"]
    assert image.shape == (33, 5, 4, 3) and image.shards == (8, 5, 4, 3) and image.chunks == (1, 5, 4, 3)
    np.testing.assert_array_equal(image[:], recs)
    np.testing.assert_array_equal(image[[3, 17, 32]], recs[[3, 17, 32]])
    np.testing.assert_array_equal(group["label"][:], np.arange(33) % 3)
    assert group.attrs["shardkit"]["num_records"] == 33


@pytest.mark.parametrize("compressors", [None, "zstd"])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_shardkit_reads_zarr(tmp_path: Path, compressors: str | None, dtype: str) -> None:
    recs = make_records(29, (6, 2), dtype)
    arr = zarr.create_array(
        store=str(tmp_path / "z"), shape=recs.shape, chunks=(1, 6, 2), shards=(10, 6, 2), dtype=dtype,
        compressors=None if compressors is None else zarr.codecs.ZstdCodec(level=3),
        config={"write_empty_chunks": True},
    )
    arr[:] = recs
    payload = PayloadArray(tmp_path / "z")
    assert payload.num_records == 29 and payload.records_per_shard == 10
    keys = np.random.default_rng(1).permutation(29)
    np.testing.assert_array_equal(payload.read(keys), recs[keys])
    if compressors is None:
        np.testing.assert_array_equal(payload.memmap(1), recs[10:20])


def test_shardkit_reads_zarr_missing_chunks_as_fill(tmp_path: Path) -> None:
    arr = zarr.create_array(store=str(tmp_path / "z"), shape=(6, 3), chunks=(1, 3), shards=(4, 3),
                            dtype="int16", compressors=None, fill_value=0)
    arr[1] = [1, 2, 3]
    arr[5] = [4, 5, 6]  # zarr skips the empty chunks by default
    out = PayloadArray(tmp_path / "z").read(np.arange(6))
    np.testing.assert_array_equal(out, arr[:])


def test_zarr_written_group_with_shardkit_layout_opens_as_dataset(tmp_path: Path) -> None:
    # Rewrite a dataset's payload with zarr-python into the same layout: the same records give the same
    # shard files byte for byte, which shardkit reads; other records are refused by the shard identity
    # check (the metadata's tail_crc32c), as a shard from another dataset is.
    recs = make_records(21, (3, 3, 3))
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=10)
    shards = sorted(p for p in (path / "image" / "c").rglob("*") if p.is_file())
    before = [p.read_bytes() for p in shards]
    arr = zarr.open_array(path / "image", mode="r+")
    arr[:] = recs
    assert [p.read_bytes() for p in shards] == before
    with open_dataset(path) as ds:
        np.testing.assert_array_equal(ds.payload.read(np.arange(21)), recs)
    arr[:] = recs[::-1]
    with open_dataset(path) as ds, pytest.raises(errors.ChecksumError, match=r"image/c/0/0/0/0.*not the dataset's shard"):
        ds.payload.read(np.arange(21))
