"""Atomic shard files, metadata last, continuing after completed shards, clean out-of-space errors."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats.writer import WrittenShard
from tests.helpers.datasets import make_records

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


def _count_writes_in_close(tmp_path: Path, monkeypatch) -> list[str]:
    """Paths written by ``close()`` of a dataset whose shards are all complete, one per os.write call."""
    recs = make_records(10, (4, 4))
    w = _writer(tmp_path / "count")
    _feed_all(w, recs)
    written: list[str] = []
    real = os.write

    def spy(fd: int, data) -> int:
        written.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, data)

    monkeypatch.setattr(os, "write", spy)
    w.close()
    monkeypatch.setattr(os, "write", real)
    return written


def _feed_all(w: DatasetWriter, recs: np.ndarray) -> None:
    w.write({"image": recs, "label": np.arange(recs.shape[0])})  # 10 records = two full shards of 5


def test_enospc_at_every_metadata_write_names_the_file_and_leaves_nothing_partial(tmp_path: Path, monkeypatch) -> None:
    # close() writes the field chunks, the field and payload documents, then the root document; a
    # full disk at any of those writes must name that file, leave no *.partial, and no root document.
    writes = _count_writes_in_close(tmp_path, monkeypatch)
    names = [Path(p).name.removesuffix(".partial") for p in writes]
    assert names == ["0", "zarr.json", "zarr.json", "zarr.json"]  # label/c/0, label/, image/, root
    real = os.write
    for k, target in enumerate(writes):
        out = tmp_path / f"out{k}"
        w = _writer(out)
        _feed_all(w, make_records(10, (4, 4)))
        calls = {"n": 0}

        def full_disk(fd: int, data, k: int = k, calls: dict[str, int] = calls) -> int:
            calls["n"] += 1
            if calls["n"] == k + 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data)

        monkeypatch.setattr(os, "write", full_disk)
        expected = str(out / Path(target).relative_to(tmp_path / "count")).removesuffix(".partial")
        with pytest.raises(errors.OutOfSpaceError, match=rf"^{expected}: no space left on device"):
            w.close()
        monkeypatch.setattr(os, "write", real)
        assert not list(out.rglob("*.partial")), k
        assert not (out / "zarr.json").exists()
        with pytest.raises(errors.IncompleteDatasetError):
            open_dataset(out)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_write_json_atomic_out_of_space_at_fsync(tmp_path: Path, monkeypatch, err: int) -> None:
    from shardkit.formats.metadata import write_json_atomic

    def full(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "sub" / "zarr.json"
    with pytest.raises(errors.OutOfSpaceError, match=rf"{target}: no space left"):
        write_json_atomic(target, {"a": 1})
    assert list((tmp_path / "sub").iterdir()) == []
    assert isinstance(errors.OutOfSpaceError("x"), OSError)


def test_other_write_errors_also_leave_no_partial(tmp_path: Path, monkeypatch) -> None:
    from shardkit.stores.atomic import write_bytes_atomic

    def broken(fd: int, data) -> int:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError, match="I/O error") as info:
        write_bytes_atomic(tmp_path / "f", b"data")
    assert not isinstance(info.value, errors.OutOfSpaceError)
    assert list(tmp_path.iterdir()) == []


def test_field_chunks_stay_within_the_readers_decode_bound(tmp_path: Path) -> None:
    from shardkit.formats.spec import MAX_FIELD_CHUNK_NBYTES
    from shardkit.formats.writer import field_chunk_for

    wide = {"a": FieldSpec((2**20,), "int64"), "b": FieldSpec((), "int64")}  # 8 MiB records of field a
    assert field_chunk_for(wide, 65536) == MAX_FIELD_CHUNK_NBYTES // 2**23 == 128
    assert field_chunk_for({"b": FieldSpec((), "int64")}, 1000) == 1000
    with pytest.raises(errors.SchemaError, match="field_chunk must be positive"):
        field_chunk_for(wide, 0)
    recs = make_records(9, (4, 4))
    with DatasetWriter(tmp_path / "ds", kind="test", payload="image", record=REC, field_chunk=4,
                       fields={"label": FieldSpec((), "int64")}) as w:
        w.write({"image": recs, "label": np.arange(9)})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.meta.field_chunk == 4 and len(ds.meta.field_chunk_keys("label")) == 3
        np.testing.assert_array_equal(ds.fields["label"], np.arange(9))


def _flush_threads_ended() -> None:
    for thread in threading.enumerate():
        if thread.name == "shardkit-flush":
            thread.join(10)


@pytest.mark.parametrize("durable", [True, False])
def test_a_durable_shard_is_flushed_in_the_background_while_it_is_written(tmp_path: Path, monkeypatch,
                                                                         durable: bool) -> None:
    # Every FLUSH_BYTES written are fdatasynced by a thread while the shard is still open, so its fsync at
    # close waits only for the last few; a scratch (not durable) shard never flushes.
    from shardkit.formats import writer as writer_module
    from shardkit.formats.writer import ShardWriter

    flushed: list[tuple[int, bool]] = []  # (file size at the flush, whether close had begun)
    closing = False
    monkeypatch.setattr(writer_module, "FLUSH_BYTES", 100)
    monkeypatch.setattr(os, "fdatasync", lambda fd: flushed.append((os.fstat(fd).st_size, closing)))
    w = ShardWriter(tmp_path / "s", 20, REC, durable=durable)  # 16-byte records
    for _ in range(10):
        w.append(np.zeros((2, 4, 4), np.uint8))  # 32 bytes a call: 320 in all
    _flush_threads_ended()
    closing = True
    w.close()
    assert not [t for t in threading.enumerate() if t.name == "shardkit-flush"]  # none left for a fork to meet
    if durable:
        assert flushed and all(size >= 128 and not late for size, late in flushed)
        assert max(size for size, _ in flushed) >= 256  # the second request was flushed too
    else:
        assert flushed == []
    assert (tmp_path / "s").stat().st_size == 320 + 20 * 16 + 4  # records, dense index, its crc32c


def test_the_writer_never_waits_for_a_background_flush(tmp_path: Path, monkeypatch) -> None:
    # Requests made while a flush runs are merged into one more flush after it; the writer goes on.
    from shardkit.formats import writer as writer_module
    from shardkit.formats.writer import ShardWriter

    started, release = threading.Event(), threading.Event()
    sizes: list[int] = []

    def slow_fdatasync(fd: int) -> None:
        sizes.append(os.fstat(fd).st_size)
        started.set()
        assert release.wait(10)

    monkeypatch.setattr(writer_module, "FLUSH_BYTES", 64)
    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    w = ShardWriter(tmp_path / "s", 20, REC)
    w.append(np.zeros((4, 4, 4), np.uint8))  # 64 bytes: the first flush starts and blocks
    assert started.wait(10)
    for _ in range(4):
        w.append(np.zeros((4, 4, 4), np.uint8))  # four more requests while it is blocked
    assert sizes == [64] and not release.is_set()
    release.set()
    w.close()
    assert len(sizes) == 2 and sizes[1] >= 320  # one flush for the four requests made meanwhile


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("seen_by", ["close", "append"])
def test_a_failed_background_flush_stops_the_shard_naming_its_file(tmp_path: Path, monkeypatch, err: int,
                                                                  seen_by: str) -> None:
    # The flusher's error is raised by the writer's next write or its close (a failed writeback is
    # reported to one fsync only): a full disk as OutOfSpaceError, others as OSError, naming the file;
    # the .partial is removed.
    from shardkit.formats import writer as writer_module
    from shardkit.formats.writer import ShardWriter

    def failing(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(writer_module, "FLUSH_BYTES", 64)
    monkeypatch.setattr(os, "fdatasync", failing)
    w = ShardWriter(tmp_path / "s", 20, REC)
    w.append(np.zeros((4, 4, 4), np.uint8))
    _flush_threads_ended()
    expected = errors.OutOfSpaceError if err == errno.ENOSPC else OSError
    with pytest.raises(expected, match=r"s\.partial") as caught:
        if seen_by == "close":
            w.close()
        else:
            w.append(np.zeros((1, 4, 4), np.uint8))
    assert caught.value.errno == err or err == errno.ENOSPC
    assert not (tmp_path / "s.partial").exists() and not (tmp_path / "s").exists()


def test_start_writeback_is_only_a_hint(tmp_path: Path) -> None:
    from shardkit.stores.atomic import start_writeback

    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    fd = os.open(path, os.O_RDWR)
    try:
        start_writeback(fd, 0, 10000)
        start_writeback(fd, 0, 0)
    finally:
        os.close(fd)
    r, w = os.pipe()  # a pipe refuses it (ESPIPE): still no error
    try:
        start_writeback(w, 0, 1)
    finally:
        os.close(r)
        os.close(w)
    assert path.read_bytes() == b"x" * 10000


def test_the_field_arrays_of_a_local_dataset_are_written_at_the_same_time(tmp_path: Path, monkeypatch) -> None:
    # Each durable file waits for its fsyncs: arrays written together share the journal's commits. The
    # first fsync of each writing thread waits for the other's (sequential writes never get there).
    import threading

    from shardkit.formats.fields import write_field_array, write_field_arrays

    arrays = [("a", FieldSpec((), "int64"), np.arange(10), 4, 0),
              ("b", FieldSpec((2,), "uint8"), np.ones((10, 2), np.uint8), 4, 0)]
    expected = {}
    for name, spec, data, chunk, first in arrays:
        expected |= write_field_array(tmp_path / "one", name, spec, data, chunk, None, first_chunk=first)
    barrier = threading.Barrier(2, timeout=20)
    waited: set[int] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    files = write_field_arrays(tmp_path / "both", arrays, None)
    monkeypatch.setattr(os, "fsync", real)
    assert list(files.items()) == list(expected.items())
    for rel in files:
        assert (tmp_path / "both" / rel).read_bytes() == (tmp_path / "one" / rel).read_bytes()


def test_synced_together_holds_back_fsyncs_until_its_end(tmp_path: Path, monkeypatch) -> None:
    # Files and directories written in the block are fsynced once it ends (all files first), each file
    # renamed into place at once; after a failure nothing is synced; synced_now syncs as it goes.
    from shardkit.stores import atomic

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: object, dst: object) -> None:
        events.append("rename " + os.path.basename(str(dst)))
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    (tmp_path / "d").mkdir()
    with atomic.synced_together():
        atomic.write_bytes_atomic(tmp_path / "d" / "a", b"a")
        atomic.write_bytes_atomic(tmp_path / "b", b"b")
        with atomic.synced_now():
            atomic.write_bytes_atomic(tmp_path / "now", b"n")
        assert (tmp_path / "d" / "a").read_bytes() == b"a"
        assert events == ["rename a", "rename b", "fsync now.partial", "rename now", f"fsync {tmp_path.name}"]
    assert events[5:] == ["fsync a", "fsync b", "fsync d", f"fsync {tmp_path.name}"]
    events.clear()
    with pytest.raises(RuntimeError), atomic.synced_together():
        atomic.write_bytes_atomic(tmp_path / "c", b"c")
        raise RuntimeError("stop")
    assert events == ["rename c"]
    atomic.write_bytes_atomic(tmp_path / "e", b"e")  # outside a block: as before
    assert events[1:] == ["fsync e.partial", "rename e", f"fsync {tmp_path.name}"]
