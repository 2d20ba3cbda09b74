"""Atomic shard files, metadata last, continuing after completed shards, clean out-of-space errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats.writer import WrittenShard
from tests.conftest import make_records

REC = FieldSpec((4, 4), "uint8")


def _writer(path: Path, **kw) -> DatasetWriter:
    return DatasetWriter(path, kind="test", payload="image", record=REC,
                         fields={"label": FieldSpec((), "int64")}, records_per_shard=5, **kw)


def _feed(w: DatasetWriter, recs: np.ndarray, start: int, stop: int) -> None:
    # Input i becomes a record unless i % 7 == 3 (skipped).
    for i in range(start, stop):
        if i % 7 == 3:
            w.skip(f"in/{i}.jpg", "corrupt")
            continue
        w.write({"image": recs[i : i + 1], "label": np.array([i])})


def test_aborted_write_is_incomplete_and_a_writer_continues_after_given_shards(tmp_path: Path) -> None:
    recs = make_records(40, (4, 4))
    ref = tmp_path / "ref"
    with _writer(ref) as w:
        _feed(w, recs, 0, 40)

    out = tmp_path / "out"
    completed: list[WrittenShard] = []
    w = _writer(out, on_shard=completed.append)
    _feed(w, recs, 0, 22)  # 19 records: 3 complete shards, 4 records in the open one
    w.abort()  # the open shard is gone, complete shard files stay
    assert [c.info.stop for c in completed] == [5, 10, 15]
    assert completed[1].fields["label"].tolist() == [6, 7, 8, 9, 11]  # input 10 was skipped
    with pytest.raises(errors.IncompleteDatasetError):
        open_dataset(out)
    assert not list(out.rglob("*.partial"))

    w2 = _writer(out, start=completed)
    assert w2.records_written == 15
    for i in range(40):
        if i % 7 == 3:
            w2.skip(f"in/{i}.jpg", "corrupt")
    for i in range(17, 40):
        if i % 7 != 3:
            w2.write({"image": recs[i : i + 1], "label": np.array([i])})
    w2.close()

    a, b = open_dataset(ref), open_dataset(out)
    assert [s.to_json() for s in a.meta.shards] == [s.to_json() for s in b.meta.shards]
    for s in a.meta.shards:
        assert (ref / s.path).read_bytes() == (out / s.path).read_bytes()
    np.testing.assert_array_equal(a.fields["label"], b.fields["label"])
    assert [x.path for x in a.meta.skipped] == [x.path for x in b.meta.skipped] == [
        f"in/{i}.jpg" for i in range(40) if i % 7 == 3]


def test_start_must_continue_the_shard_sequence(tmp_path: Path) -> None:
    completed: list[WrittenShard] = []
    w = _writer(tmp_path / "out", on_shard=completed.append)
    w.write({"image": make_records(10, (4, 4)), "label": np.arange(10)})
    w.abort()
    with pytest.raises(errors.SchemaError, match="cannot continue after shard image/c/1/0/0"):
        _writer(tmp_path / "out", start=completed[1:])
    bad = WrittenShard(completed[0].info, {"label": np.arange(4)})
    with pytest.raises(errors.SchemaError, match="label"):
        _writer(tmp_path / "out", start=[bad])


def test_writer_never_replaces_a_dataset(tmp_path: Path) -> None:
    with _writer(tmp_path / "out") as w:
        w.write({"image": make_records(3, (4, 4)), "label": np.arange(3)})
    before = (tmp_path / "out" / "zarr.json").read_bytes()
    with pytest.raises(errors.ConfigError, match="a dataset already exists here"):
        _writer(tmp_path / "out")
    assert (tmp_path / "out" / "zarr.json").read_bytes() == before


def test_out_of_space_is_a_clear_error_and_leaves_no_partial(tmp_path: Path, monkeypatch) -> None:
    recs = make_records(12, (4, 4))
    completed: list[WrittenShard] = []
    w = _writer(tmp_path / "out", on_shard=completed.append)
    _feed(w, recs, 0, 6)  # first shard complete
    real_write = os.write

    def full_disk(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(errors.OutOfSpaceError, match=r"image/c/1/0/0.partial: no space"):
        _feed(w, recs, 6, 12)
    monkeypatch.setattr(os, "write", real_write)
    assert not list((tmp_path / "out").rglob("*.partial"))
    w.abort()
    # the completed shard survived; a writer continues after it
    w2 = _writer(tmp_path / "out", start=completed)
    assert w2.records_written == 5
    _feed(w2, recs, 6, 12)
    w2.close()
    assert verify(tmp_path / "out").ok


def test_schema_mismatch_is_reported(tmp_path: Path) -> None:
    w = _writer(tmp_path / "out")
    with pytest.raises(errors.SchemaError, match=r"expected shape \(1, 4, 4\), found \(1, 4, 5\)"):
        w.write({"image": np.zeros((1, 4, 5), np.uint8), "label": np.array([0])})
    with pytest.raises(errors.SchemaError, match="lacks fields"):
        w.write({"image": np.zeros((1, 4, 4), np.uint8)})


@pytest.mark.parametrize("durable", [True, False])
def test_durable_controls_fsync_only(tmp_path: Path, monkeypatch, durable: bool) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    recs = make_records(12, (4, 4))
    with DatasetWriter(tmp_path / "out", kind="test", payload="image", record=REC, records_per_shard=5,
                       durable=durable) as w:
        w.write({"image": recs})
    assert (len(calls) > 0) is durable
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.payload.read_range(0, 12), recs)
