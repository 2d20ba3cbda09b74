"""The committed golden datasets of every format version stay readable, by shardkit and by zarr-python.

``v1.0-*`` were written by format 1.0 and are frozen byte for byte (pinned below); ``v1.1-*`` by the
current format (``make_golden.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from shardkit.formats import FORMAT_MINOR, FORMAT_VERSION, open_dataset, verify
from shardkit.formats.index import crc32c_of
from tests.formats.golden.make_golden import golden_boxes, golden_labels, golden_records

GOLDEN = Path(__file__).parent / "golden"
ALL = ["v1.0-plain", "v1.0-zstd", "v1.1-plain", "v1.1-zstd"]

#: crc32c of every file of the frozen format 1.0 golden datasets: they must never be regenerated.
FROZEN_1_0 = {
    "v1.0-plain": {
        "boxes/c/0/0/0": 395668338, "boxes/zarr.json": 1286910883, "image/c/0/0/0/0": 1331246792,
        "image/c/1/0/0/0": 3567062416, "image/c/2/0/0/0": 1937572193, "image/zarr.json": 903284592,
        "label/c/0": 267558920, "label/zarr.json": 2612003896, "zarr.json": 4274250587,
    },
    "v1.0-zstd": {
        "boxes/c/0/0/0": 395668338, "boxes/zarr.json": 1286910883, "image/c/0/0/0/0": 1903702777,
        "image/c/1/0/0/0": 1026020349, "image/c/2/0/0/0": 336830437, "image/zarr.json": 1564021959,
        "label/c/0": 267558920, "label/zarr.json": 2612003896, "zarr.json": 1846820490,
    },
}


@pytest.mark.parametrize("name", ALL)
def test_golden_decodes(name: str) -> None:
    path = GOLDEN / name
    minor = int(name.split("-")[0].split(".")[1])
    report = verify(path)
    assert report.ok, report.problems
    assert report.format == f"1.{minor}"
    with open_dataset(path) as ds:
        assert (ds.meta.format_version, ds.meta.format_minor) == (1, minor)
        assert ds.meta.format_version == FORMAT_VERSION and ds.meta.format_minor <= FORMAT_MINOR
        assert ds.meta.kind == "golden" and ds.label_names == ["cat", "dog", "owl"]
        assert [(s.start, s.stop) for s in ds.meta.shards] == [(0, 3), (3, 6), (6, 7)]
        np.testing.assert_array_equal(ds.payload.read_range(0, 7), golden_records())
        np.testing.assert_array_equal(ds.fields["label"], golden_labels())
        np.testing.assert_array_equal(ds.fields["boxes"], golden_boxes())
    group = zarr.open_group(path, mode="r")
    np.testing.assert_array_equal(group["image"][:], golden_records())
    np.testing.assert_array_equal(group["label"][:], golden_labels())
    np.testing.assert_array_equal(group["boxes"][:], golden_boxes())


def test_verify_says_what_a_1_0_dataset_cannot_have() -> None:
    old = verify(GOLDEN / "v1.0-plain")
    assert old.ok and any("written by format 1.0: field chunks" in x for x in old.limitations)
    assert any("shard indexes are not bound" in x for x in old.limitations)
    assert verify(GOLDEN / "v1.1-plain").limitations == []


@pytest.mark.parametrize("name", sorted(FROZEN_1_0))
def test_format_1_0_golden_files_are_byte_identical(name: str) -> None:
    root = GOLDEN / name
    found = {str(f.relative_to(root)): crc32c_of(f.read_bytes()) for f in sorted(root.rglob("*")) if f.is_file()}
    assert found == FROZEN_1_0[name]


def test_golden_1_1_metadata_has_every_checksum() -> None:
    with open_dataset(GOLDEN / "v1.1-zstd") as ds:
        m = ds.meta
        assert all(s.data_crc32c is not None and s.index_crc32c is not None for s in m.shards)
        assert sorted(m.files) == sorted([
            "image/zarr.json", "label/zarr.json", "label/c/0", "label/c/1",
            "boxes/zarr.json", "boxes/c/0/0/0", "boxes/c/1/0/0",
        ])
        assert m.compression == {"name": "zstd", "level": 3, "checksum": True}
    doc = zarr.open_group(GOLDEN / "v1.1-zstd", mode="r").attrs["shardkit"]
    assert isinstance(doc["attributes_crc32c"], int)


@pytest.mark.parametrize("name", ["v1.0-plain", "v1.1-plain"])
def test_golden_plain_bytes_are_the_documented_layout(name: str) -> None:
    raw = (GOLDEN / name / "image" / "c" / "2" / "0" / "0" / "0").read_bytes()
    # one record (36 bytes) | 3 index entries of 16 bytes | crc32c
    assert len(raw) == 36 + 3 * 16 + 4
    assert raw[:36] == golden_records()[6].tobytes()
    entries = np.frombuffer(raw[36:84], "<u8").reshape(3, 2)
    assert entries[0].tolist() == [0, 36]
    assert (entries[1:] == 2**64 - 1).all()


def test_zstd_frames_carry_their_checksum_since_1_1() -> None:
    # zstd frame header descriptor byte (after the 4-byte magic): bit 2 is Content_Checksum_flag.
    for name, flag in (("v1.0-zstd", 0), ("v1.1-zstd", 1)):
        raw = (GOLDEN / name / "image" / "c" / "0" / "0" / "0" / "0").read_bytes()
        assert raw[:4] == b"\x28\xb5\x2f\xfd"
        assert (raw[4] >> 2) & 1 == flag, name
        label = (GOLDEN / name / "label" / "c" / "0").read_bytes()
        assert (label[4] >> 2) & 1 == flag, name
