"""Format 1.1 integrity: every byte a reader trusts is covered by a checksum recorded in the metadata.

Issue 10 items 5 (shard index), 6 (fields and documents, zstd frame checksums), 8 (older datasets)
and the version policy.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats.codecs import get_codec
from tests.helpers.datasets import edit_attributes, flip_byte, make_records, rewrite_shard_index, write_dataset

GOLDEN = Path(__file__).parent / "golden"
REC = FieldSpec((4, 3, 3), "uint8")  # 36-byte records


def _shard(path: Path, i: int) -> Path:
    return path / "image" / "c" / str(i) / "0" / "0" / "0"


def _dataset(path: Path, n: int = 30, compression: str | None = None, field_chunk: int = 8) -> Path:
    recs = make_records(n)
    with DatasetWriter(path, kind="test", payload="image", record=REC, records_per_shard=10,
                       fields={"label": FieldSpec((), "int64"), "boxes": FieldSpec((2, 4), "float32")},
                       field_chunk=field_chunk, compression=compression) as w:
        w.write({"image": recs, "label": np.arange(n) % 5,
                 "boxes": np.arange(n * 8, dtype=np.float32).reshape(n, 2, 4)})
    return path


# ------------------------------------------------------------------ item 5: the index is covered
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_changed_index_offset_with_valid_crc_fails_verify_and_the_reader(tmp_path: Path, compression: str | None) -> None:
    # The issue's repro: point record 8 of a shard at record 5's bytes, rewrite a valid index crc32c.
    path = _dataset(tmp_path / "ds", compression=compression)
    with open_dataset(path) as ds:
        expected = ds.payload.read([12, 15, 18])
    f = _shard(path, 1)

    def point_8_at_5(table: np.ndarray) -> None:
        table[8] = table[5]

    rewrite_shard_index(f, 10, point_8_at_5)
    report = verify(path, quick=True)  # even quick mode: the index is compared with the metadata
    assert [p.path for p in report.problems] == [str(f)]
    assert "recorded in the dataset metadata" in report.problems[0].message
    assert not verify(path).ok
    with open_dataset(path) as ds, pytest.raises(errors.CorruptIndexError, match=r"image/c/1/0/0/0.*recorded"):
        ds.payload.read([18])
    with open_dataset(path) as ds:  # other shards still read
        np.testing.assert_array_equal(ds.payload.read([2]), make_records(30)[[2]])
    assert expected.shape == (3, 4, 3, 3)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_swapped_index_entries_are_caught_by_the_recorded_index_crc(tmp_path: Path, compression: str | None) -> None:
    # A swap keeps entries inside the file and non-overlapping: only the recorded crc32c sees it.
    path = _dataset(tmp_path / "ds", compression=compression)
    rewrite_shard_index(_shard(path, 0), 10, lambda t: t.__setitem__([0, 1], t[[1, 0]]))
    with open_dataset(path) as ds, pytest.raises(errors.CorruptIndexError):
        ds.payload.read([0])
    assert not verify(path, quick=True).ok


def test_format_1_0_reader_refuses_a_moved_record_by_the_dense_layout(tmp_path: Path) -> None:
    # 1.0 metadata records no index checksum: the fixed-size layout check is what refuses a swap
    # (a swap keeps the entries inside the file and apart, so nothing else would see it).
    path = tmp_path / "old"
    shutil.copytree(GOLDEN / "v1.0-plain", path)
    rewrite_shard_index(_shard(path, 1), 3, lambda t: t.__setitem__([0, 2], t[[2, 0]]))
    with open_dataset(path) as ds, pytest.raises(errors.CorruptIndexError, match="fixed-size layout"):
        ds.payload.read([5])
    report = verify(path, quick=True)
    assert [p.path.endswith("image/c/1/0/0/0") for p in report.problems] == [True]


def test_overlapping_entries_of_a_compressed_1_0_shard_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "old"
    shutil.copytree(GOLDEN / "v1.0-zstd", path)
    rewrite_shard_index(_shard(path, 0), 3, lambda t: t.__setitem__(2, t[1]))
    with open_dataset(path) as ds, pytest.raises(errors.CorruptIndexError, match="overlap"):
        ds.payload.read([2])


def test_records_and_index_are_checksummed_separately(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    with open_dataset(path) as ds:
        info = ds.meta.shards[0]
    raw = _shard(path, 0).read_bytes()
    from shardkit.formats.index import crc32c_of

    assert info.data_crc32c == crc32c_of(raw[: 10 * 36])
    assert info.index_crc32c == int.from_bytes(raw[-4:], "little") == crc32c_of(raw[10 * 36 : -4])
    assert info.crc32c == crc32c_of(raw)  # the 1.0 whole-file value, still written for 1.0 readers


# ------------------------------------------------------------------ item 6: fields and documents
def test_every_single_bit_flip_of_a_label_chunk_fails_verify_and_fields(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds", n=30, field_chunk=8)
    chunk = path / "label" / "c" / "1"
    original = chunk.read_bytes()
    assert verify(path).ok
    caught_verify = caught_fields = 0
    for bit in range(8 * len(original)):
        flip_byte(chunk, bit // 8, 1 << (bit % 8))
        report = verify(path)
        caught_verify += [p.path for p in report.problems] == [str(chunk)]
        with open_dataset(path) as ds:
            try:
                ds.fields  # noqa: B018 - loading is the check
            except errors.ChecksumError as exc:
                caught_fields += "label/c/1" in str(exc)
        chunk.write_bytes(original)
    assert caught_verify == caught_fields == 8 * len(original)


def test_deleted_label_chunk_fails_verify_and_fields(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    (path / "label" / "c" / "2").unlink()
    report = verify(path, quick=True)
    assert [p.path for p in report.problems] == [str(path / "label" / "c" / "2")]
    assert "missing" in report.problems[0].message
    with open_dataset(path) as ds, pytest.raises(errors.MissingShardError, match=r"label/c/2"):
        ds.fields  # noqa: B018


def test_deleted_field_chunk_of_a_1_0_dataset_is_an_error_not_zeros(tmp_path: Path) -> None:
    # shardkit always wrote every chunk, so a missing one was lost (zarr would read it as zeros).
    path = tmp_path / "old"
    shutil.copytree(GOLDEN / "v1.0-plain", path)
    (path / "label" / "c" / "0").unlink()
    with open_dataset(path) as ds, pytest.raises(errors.MissingShardError, match=r"label/c/0"):
        ds.fields  # noqa: B018
    assert not verify(path).ok


def test_field_chunk_rewritten_as_valid_zstd_fails_on_its_recorded_crc(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    codec = get_codec("zstd")
    assert codec is not None
    chunk = path / "label" / "c" / "0"
    values = np.empty(8, dtype="<i8")
    codec.decode(chunk.read_bytes(), values)
    # Other plausible labels in a zstd frame with a valid checksum, of the same size, so that only the
    # recorded crc32c can tell.
    size = len(chunk.read_bytes())
    forged = [f for k in range(1, 5) if len(f := codec.encode((values + k) % 5)) == size]
    assert forged
    chunk.write_bytes(forged[0])
    with open_dataset(path) as ds, pytest.raises(errors.ChecksumError, match=r"label/c/0: crc32c"):
        ds.fields  # noqa: B018
    assert [p.path for p in verify(path).problems] == [str(chunk)]


@pytest.mark.parametrize("doc", ["image/zarr.json", "label/zarr.json", "boxes/zarr.json"])
def test_changed_array_document_is_refused_at_open(tmp_path: Path, doc: str) -> None:
    path = _dataset(tmp_path / "ds")
    f = path / doc
    data = json.loads(f.read_text())
    data["fill_value"] = 1  # still a valid zarr document, but not the one that was written
    f.write_text(json.dumps(data, indent=2))
    # a size change is a TruncatedShardError, a same-size change a ChecksumError: both CorruptShardError
    with pytest.raises(errors.CorruptShardError, match=doc):
        open_dataset(path)
    with pytest.raises(errors.CorruptShardError, match=doc):
        verify(path)


def test_zstd_frame_checksum_catches_a_flipped_record_byte_on_read(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds", compression="zstd")
    with open_dataset(path) as ds:
        off, size = int(ds.payload.index(0).offsets[4]), int(ds.payload.index(0).nbytes[4])
    flip_byte(_shard(path, 0), off + size - 6, 0x01)  # a literal or the frame checksum of record 4
    with open_dataset(path) as ds, pytest.raises(errors.CorruptShardError, match=r"image/c/0/0/0/0"):
        ds.payload.read([4])


def test_attributes_carry_their_own_checksum(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    edit_attributes(path, lambda a: a["labels"].__setitem__("label", ["x"]), fix_checksum=False)
    with pytest.raises(errors.ChecksumError, match=r"zarr.json: the 'shardkit' attributes"):
        open_dataset(path)


def test_every_single_byte_change_of_the_root_document_is_refused(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds", n=12)
    doc = path / "zarr.json"
    original = doc.read_bytes()
    for pos in range(len(original)):
        raw = bytearray(original)
        raw[pos] ^= 0x01
        doc.write_bytes(bytes(raw))
        with pytest.raises(errors.ShardkitError):
            open_dataset(path).close()
    doc.write_bytes(original)
    assert verify(path).ok


def test_a_flipped_minor_version_does_not_switch_the_checks_off(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    edit_attributes(path, lambda a: a.__setitem__("format_minor", 0), fix_checksum=False)
    with pytest.raises(errors.ChecksumError):
        open_dataset(path)


# ------------------------------------------------------------------ item 8: versions
def test_newer_minor_is_read_with_a_warning_and_listed_by_verify(tmp_path: Path, caplog) -> None:
    path = _dataset(tmp_path / "ds")
    edit_attributes(path, lambda a: a.__setitem__("format_minor", 7))
    with caplog.at_level(logging.WARNING, logger="shardkit.formats.metadata"), open_dataset(path) as ds:
        assert ds.meta.format == "1.7"
        np.testing.assert_array_equal(ds.fields["label"], np.arange(30) % 5)
    assert "format 1.7, newer than this shardkit's 1.1" in caplog.text
    report = verify(path)
    assert report.ok and report.limitations == [
        "written by format 1.7, newer than this shardkit's 1.1: checks added since are not run"]


def test_newer_major_is_refused(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    edit_attributes(path, lambda a: a.__setitem__("format_version", 2))
    with pytest.raises(errors.FormatVersionError, match="version 2"):
        open_dataset(path)


def test_1_1_metadata_without_its_checksums_is_refused(tmp_path: Path) -> None:
    path = _dataset(tmp_path / "ds")
    edit_attributes(path, lambda a: a["shards"][1].pop("index_crc32c"))
    with pytest.raises(errors.NotADatasetError, match="index_crc32c"):
        open_dataset(path)
    path2 = _dataset(tmp_path / "ds2")
    edit_attributes(path2, lambda a: a["files"].pop("label/c/1"))
    with pytest.raises(errors.NotADatasetError, match=r"'files' must list .*label/c/1"):
        open_dataset(path2)


def test_writer_records_every_file_and_verify_counts_them(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10)
    report = verify(path)
    assert report.ok and report.format == "1.1" and report.limitations == []
    assert report.shards_checked == 3 and report.files_checked == 3  # image doc, label doc, one label chunk
