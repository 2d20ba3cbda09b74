"""Every damaged or foreign input gives a specific ShardkitError that names the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import open_dataset, verify


def _shard(path: Path, i: int) -> Path:
    return path / "image" / "c" / str(i) / "0" / "0" / "0"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(errors.DatasetNotFoundError, match="nope"):
        open_dataset(tmp_path / "nope")
    assert issubclass(errors.DatasetNotFoundError, FileNotFoundError)


def test_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(errors.NotADatasetError, match=str(tmp_path)):
        open_dataset(tmp_path)
    (tmp_path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(errors.NotADatasetError, match="without 'shardkit' attributes"):
        open_dataset(tmp_path)
    (tmp_path / "zarr.json").write_text("{not json")
    with pytest.raises(errors.NotADatasetError, match="not valid JSON"):
        open_dataset(tmp_path)


def test_newer_format_version(small_dataset) -> None:
    path, _ = small_dataset()
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["shardkit"]["format_version"] = 99
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(errors.FormatVersionError, match="version 99"):
        open_dataset(path)


def test_incomplete_dataset(small_dataset) -> None:
    path, _ = small_dataset()
    (path / "zarr.json").unlink()
    with pytest.raises(errors.IncompleteDatasetError, match="incomplete"):
        open_dataset(path)


def test_missing_shard(small_dataset) -> None:
    path, _ = small_dataset(n=30)
    _shard(path, 1).unlink()
    with open_dataset(path) as ds:
        ds.payload.read([0])
        with pytest.raises(errors.MissingShardError, match=r"c/1/0/0/0.*records 10-19"):
            ds.payload.read([15])
    report = verify(path)
    assert not report.ok and report.problems[0].start == 10 and "c/1/0/0/0" in report.problems[0].path


def test_truncated_shard(small_dataset) -> None:
    path, _ = small_dataset(n=30)
    f = _shard(path, 2)
    f.write_bytes(f.read_bytes()[:-30])
    with open_dataset(path) as ds, pytest.raises(errors.TruncatedShardError, match=r"c/2/0/0/0"):
        ds.payload.read([25])
    assert isinstance(errors.TruncatedShardError("x"), ValueError)


def test_truncated_shard_without_metadata_sizes_is_still_caught(tmp_path: Path) -> None:
    # A bare zarr array has no recorded sizes: the index bounds check catches the truncation.
    import zarr

    arr = zarr.create_array(store=str(tmp_path / "z"), shape=(8, 4), chunks=(1, 4), shards=(8, 4),
                            dtype="uint8", compressors=None)
    arr[:] = np.arange(32, dtype=np.uint8).reshape(8, 4)
    f = tmp_path / "z" / "c" / "0" / "0"
    raw = f.read_bytes()
    f.write_bytes(raw[:10] + raw[-(8 * 16 + 4):])  # records cut, index kept
    from shardkit.formats import PayloadArray

    with pytest.raises(errors.CorruptIndexError, match="past the"):
        PayloadArray(tmp_path / "z").read([0])


def test_corrupt_index(small_dataset) -> None:
    path, _ = small_dataset(n=30)
    f = _shard(path, 0)
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0x01  # inside the index
    f.write_bytes(bytes(raw))
    with open_dataset(path) as ds, pytest.raises(errors.CorruptIndexError, match=r"c/0/0/0/0.*crc32c"):
        ds.payload.read([3])
    report = verify(path, quick=True)
    assert not report.ok and "crc32c" in report.problems[0].message


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_flipped_bit_in_a_record_fails_verify_naming_the_shard(small_dataset, codec: str | None) -> None:
    path, _ = small_dataset(n=30, compression=codec)
    f = _shard(path, 1)
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0x10
    f.write_bytes(bytes(raw))
    # quick reads each index with the last 4 KiB of its shard's records (tail_crc32c): in these small
    # shards that is every record, so quick catches the flip too
    assert not verify(path, quick=True).ok
    report = verify(path)
    assert len(report.problems) == 1
    p = report.problems[0]
    assert p.path.endswith("image/c/1/0/0/0") and (p.start, p.stop) == (10, 20)
    assert "crc32c" in p.message
    assert issubclass(errors.ChecksumError, errors.CorruptShardError)


def test_flipped_byte_in_any_shard_is_found(small_dataset) -> None:
    path, _ = small_dataset(n=45)
    rng = np.random.default_rng(0)
    for i in range(5):
        f = _shard(path, i)
        backup = f.read_bytes()
        raw = bytearray(backup)
        pos = int(rng.integers(0, len(raw)))
        raw[pos] ^= 0xFF
        f.write_bytes(bytes(raw))
        report = verify(path)
        assert [q.path.endswith(f"image/c/{i}/0/0/0") for q in report.problems] == [True], (i, pos)
        f.write_bytes(backup)
    assert verify(path).ok


def test_corrupt_compressed_record_raises_on_read(small_dataset) -> None:
    path, _ = small_dataset(n=12, compression="zstd")
    f = _shard(path, 0)
    raw = bytearray(f.read_bytes())
    raw[2] ^= 0xFF  # zstd frame magic of record 0
    f.write_bytes(bytes(raw))
    with open_dataset(path) as ds, pytest.raises(errors.CorruptShardError, match=r"c/0/0/0/0"):
        ds.payload.read([0])


def test_every_error_is_a_shardkit_error_and_a_builtin() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ShardkitError)
        if cls is not errors.ShardkitError:
            builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
            assert builtin_bases, name


def test_out_of_range_key(small_dataset) -> None:
    path, _ = small_dataset(n=10)
    with open_dataset(path) as ds, pytest.raises(IndexError, match="outside"):
        ds.payload.read([10])
    shutil.rmtree(path)
