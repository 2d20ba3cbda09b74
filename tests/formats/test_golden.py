"""The committed v1 golden datasets stay readable, by shardkit and by zarr-python, forever."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from shardkit.formats import FORMAT_VERSION, open_dataset, verify
from tests.formats.golden.make_golden import golden_boxes, golden_labels, golden_records

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ["v1-plain", "v1-zstd"])
def test_golden_v1_decodes(name: str) -> None:
    path = GOLDEN / name
    assert verify(path).ok
    with open_dataset(path) as ds:
        assert ds.meta.format_version == 1 <= FORMAT_VERSION
        assert ds.meta.kind == "golden" and ds.label_names == ["cat", "dog", "owl"]
        assert [(s.start, s.stop) for s in ds.meta.shards] == [(0, 3), (3, 6), (6, 7)]
        np.testing.assert_array_equal(ds.payload.read_range(0, 7), golden_records())
        np.testing.assert_array_equal(ds.fields["label"], golden_labels())
        np.testing.assert_array_equal(ds.fields["boxes"], golden_boxes())
    group = zarr.open_group(path, mode="r")
    np.testing.assert_array_equal(group["image"][:], golden_records())


def test_golden_plain_bytes_are_the_documented_layout() -> None:
    raw = (GOLDEN / "v1-plain" / "image" / "c" / "2" / "0" / "0" / "0").read_bytes()
    # one record (36 bytes) | 3 index entries of 16 bytes | crc32c
    assert len(raw) == 36 + 3 * 16 + 4
    assert raw[:36] == golden_records()[6].tobytes()
    entries = np.frombuffer(raw[36:84], "<u8").reshape(3, 2)
    assert entries[0].tolist() == [0, 36]
    assert (entries[1:] == 2**64 - 1).all()
