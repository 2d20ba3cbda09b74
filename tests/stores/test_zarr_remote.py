"""Interop: zarr-python opens a shardkit dataset in an object store with its own store (zarr's
``ObjectStore`` over obstore) and reads the same records and fields that shardkit reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import open_dataset
from tests.helpers.datasets import make_records, upload, write_dataset
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_zarr_reads_a_remote_dataset(s3: Any, tmp_path: Path, compression: str | None) -> None:
    zarr = pytest.importorskip("zarr")
    from obstore.store import S3Store
    from zarr.storage import ObjectStore as ZarrObjectStore

    records = make_records(45)
    url = upload(write_dataset(tmp_path / "ds", records, records_per_shard=10, compression=compression), s3.url("ds"))
    bucket, prefix = url[len("s3://"):].split("/", 1)
    inner = S3Store(bucket, prefix=prefix, endpoint=s3.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region="us-east-1", client_options={"allow_http": True})
    group = zarr.open_group(ZarrObjectStore(inner, read_only=True), mode="r")
    np.testing.assert_array_equal(group["image"][:], records)
    np.testing.assert_array_equal(group["image"][17], records[17])
    with open_dataset(url) as ds:
        np.testing.assert_array_equal(group["label"][:], ds.fields["label"])
        keys = np.array([44, 3, 30])
        np.testing.assert_array_equal(ds.payload.read(keys), group["image"].get_orthogonal_selection(keys))
        assert group.attrs["shardkit"]["num_records"] == ds.num_records
