"""Round trips through shardkit's own writer and reader, for every dtype, shape and codec."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.formats import DatasetWriter, FieldSpec, ReadStats, open_dataset
from shardkit.formats.spec import INDEX_ENTRY_NBYTES, TAIL_SAMPLE_NBYTES, chunk_key
from tests.helpers.datasets import make_records, write_dataset

CODECS = [None, "zstd", "gzip", "blosc-lz4"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 40),
    per_shard=st.integers(1, 12),
    shape=st.sampled_from([(1,), (5,), (3, 2), (4, 3, 3), (2, 2, 2, 2)]),
    dtype=st.sampled_from(["uint8", "int16", "float32", "int64"]),
    codec=st.sampled_from(CODECS),
    seed=st.integers(0, 2**16),
)
def test_write_read_roundtrip(tmp_path: Path, n: int, per_shard: int, shape: tuple[int, ...], dtype: str,
                              codec: str | None, seed: int) -> None:
    recs = make_records(n, shape, dtype, seed)
    # Hypothesis reuses tmp_path across examples: every example writes to a directory of its own.
    path = write_dataset(tmp_path / f"ds-{uuid.uuid4().hex}", recs,
                         records_per_shard=per_shard, compression=codec)
    with open_dataset(path) as ds:
        assert ds.num_records == n
        assert len(ds.meta.shards) == -(-n // per_shard)
        np.testing.assert_array_equal(ds.payload.read_range(0, n), recs)
        if n:
            rng = np.random.default_rng(seed)
            keys = rng.integers(0, n, size=2 * n)  # random order with duplicates
            batch = ds.read(keys)
            np.testing.assert_array_equal(batch["image"], recs[keys])
            np.testing.assert_array_equal(batch["label"], np.arange(n)[keys] % 3)
            np.testing.assert_array_equal(batch["key"], keys)
            k = int(keys[0])
            np.testing.assert_array_equal(ds[k]["image"], recs[k])


def test_uncompressed_shard_is_records_then_index_then_crc(small_dataset) -> None:
    path, recs = small_dataset(n=25, records_per_shard=10)
    with open_dataset(path) as ds:
        rec_nbytes = ds.record_nbytes
        for i, info in enumerate(ds.meta.shards):
            raw = (path / info.path).read_bytes()
            assert len(raw) == info.count * rec_nbytes + 10 * INDEX_ENTRY_NBYTES + 4
            assert raw[: info.count * rec_nbytes] == recs[info.start : info.stop].tobytes()
            assert info.path == chunk_key("image", i, 4)
            offs = np.frombuffer(raw, "<u8", count=20, offset=info.count * rec_nbytes).reshape(10, 2)
            np.testing.assert_array_equal(offs[: info.count, 0], np.arange(info.count) * rec_nbytes)
            assert (offs[info.count :] == 2**64 - 1).all()  # slots past the last record are empty
            assert ds.payload.is_dense(i)


def test_memmap_is_zero_copy_view(small_dataset) -> None:
    path, recs = small_dataset(n=25, records_per_shard=10)
    with open_dataset(path) as ds:
        view = ds.payload.memmap(2)
        assert isinstance(view, np.memmap)
        np.testing.assert_array_equal(view, recs[20:25])


def test_memmap_refuses_compressed(small_dataset) -> None:
    path, _ = small_dataset(n=12, compression="zstd")
    with open_dataset(path) as ds, pytest.raises(ValueError, match="uncompressed"):
        ds.payload.memmap(0)


def test_sparse_read_is_ascending_and_coalesced(tmp_path: Path) -> None:
    recs = make_records(100, (8, 8, 4))  # 256-byte records
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=50)
    stats = ReadStats(trace=[])
    with open_dataset(path, stats=stats, gap_bytes=256) as ds:
        # keys in descending order; gaps of exactly one record (<= 256 bytes) are coalesced
        keys = np.array([98, 96, 94, 10, 11, 12, 40, 2])
        out = ds.payload.read(keys)
        np.testing.assert_array_equal(out, recs[keys])
    index_read = 50 * 16 + 4 + TAIL_SAMPLE_NBYTES  # each index is read with the end of the records
    data_reads = [t for t in stats.trace if t[2] != index_read]  # drop the two index reads
    files = [t[0] for t in data_reads]
    assert files == sorted(files)  # shard 0 first, then shard 1: one pass each
    # shard 0: 2 | 10,11,12 | 40 -> three runs (gap 2->10 is 7 records > 256 B); shard 1: 94..98 one run
    assert [(off, n) for _, off, n in data_reads] == [
        (2 * 256, 256), (10 * 256, 3 * 256), (40 * 256, 256), (44 * 256, 5 * 256)]
    assert stats.records == len(keys)


def test_gap_zero_reads_only_wanted_bytes(tmp_path: Path) -> None:
    recs = make_records(60, (16,))
    path = write_dataset(tmp_path / "ds", recs, records_per_shard=60)
    stats = ReadStats()
    with open_dataset(path, stats=stats, gap_bytes=0) as ds:
        ds.payload.read(np.arange(0, 60, 2))
    assert stats.bytes_read == 30 * 16 + 60 * 16 + 4 + 60 * 16  # the index is read with the records' tail (all 960 bytes)


def test_fields_of_many_shapes_roundtrip(tmp_path: Path) -> None:
    n = 23
    rng = np.random.default_rng(3)
    boxes = rng.random((n, 5, 4)).astype("float32")
    ids = rng.integers(0, 10**9, n)
    with DatasetWriter(tmp_path / "ds", kind="test", payload="audio", record=FieldSpec((32,), "int16"),
                       fields={"boxes": FieldSpec((5, 4), "float32"), "image_id": FieldSpec((), "int64")},
                       records_per_shard=4) as w:
        w.write({"audio": make_records(n, (32,), "int16"), "boxes": boxes, "image_id": ids})
    with open_dataset(tmp_path / "ds") as ds:
        np.testing.assert_array_equal(ds.fields["boxes"], boxes)
        np.testing.assert_array_equal(ds.fields["image_id"], ids)
        assert ds.payload_name == "audio"


def test_empty_dataset(tmp_path: Path) -> None:
    with DatasetWriter(tmp_path / "ds", kind="test", payload="image", record=FieldSpec((2, 2, 3), "uint8"),
                       fields={"label": FieldSpec((), "int64")}) as w:
        w.skip("a.jpg", "corrupt")
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.num_records == 0 and ds.meta.shards == []
        assert ds.fields["label"].shape == (0,)
        assert [s.path for s in ds.meta.skipped] == ["a.jpg"]
