"""The commit (formats/commit.py) and versions (formats/versions.py): appending segments equals writing in
one go, at most one re-packed shard per segment boundary, readers keep the version they opened, pruning."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from shardkit.errors import ChecksumError, ConversionError, DatasetNotFoundError, VersionGoneError
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats.commit import Segment, StoredShard, commit, merge_labels, plan_shards
from shardkit.formats.versions import VERSIONS_DIR, list_versions, retired_key
from shardkit.stores import LocalStore
from tests.helpers.datasets import make_records

S = 10


def _write(path: Path, records: np.ndarray, labels: np.ndarray, *, compression: str | None = None,
           names: tuple[str, ...] = ("a", "b", "c"), rps: int = S) -> Dataset:
    with DatasetWriter(path, kind="test", payload="image", record=FieldSpec(records.shape[1:], "uint8"),
                       fields={"label": FieldSpec((), "int64"), "pair": FieldSpec((2,), "float32")},
                       labels={"label": list(names)}, records_per_shard=rps, compression=compression) as w:
        for a in range(0, len(records), 7):
            k = labels[a : a + 7]
            w.write({"image": records[a : a + 7], "label": k, "pair": np.stack([k, -k], 1).astype(np.float32)})
    return open_dataset(path)


def _segment(ds: Dataset) -> Segment:
    shards = tuple(StoredShard.of(ds.store, s, ds.meta.records_per_shard) for s in ds.meta.shards)
    return Segment(ds.num_records, shards, lambda: ds.fields, ds.meta.labels, tuple(ds.meta.skipped))


def _same_dataset(a: Path, b: Path) -> None:
    """Every shard file, field value, label and skip of ``a`` equals ``b``'s."""
    with open_dataset(a) as x, open_dataset(b) as y:
        assert x.meta.shards == y.meta.shards
        assert x.meta.labels == y.meta.labels and x.meta.skipped == y.meta.skipped
        for k in x.fields:
            np.testing.assert_array_equal(x.fields[k], y.fields[k])
        for i in range(len(x.meta.shards)):
            assert x.payload.shard_path(i).read_bytes() == y.payload.shard_path(i).read_bytes()
        assert x.meta.files == y.meta.files  # field chunks and array documents byte-identical too


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("split", [0, 9, 10, 23, 57])
def test_append_equals_writing_in_one_go(tmp_path: Path, compression: str | None, split: int) -> None:
    records, labels = make_records(57), np.arange(57) % 3
    one = _write(tmp_path / "one", records, labels, compression=compression)
    base = _write(tmp_path / "a", records[:split], labels[:split], compression=compression) if split else None
    rest = _write(tmp_path / "b", records[split:], labels[split:], compression=compression) if split < 57 else None
    root = tmp_path / "a"
    template = base.meta if base else one.meta.with_(source={}, labels={})
    report = commit(root, template, [_segment(rest)] if rest else [], base=base.meta if base else None, plan="p",
                    history={"operation": "append"})
    assert verify(root).ok
    _same_dataset(root, tmp_path / "one")
    assert report.records_added == 57 - split
    # Only the shard the base did not fill and the shards of the misaligned segment are re-packed.
    assert report.shards_repacked <= 6 and (split % S != 0 or report.shards_repacked == 0)
    group = zarr.open_group(root, mode="r")  # still an ordinary zarr group
    np.testing.assert_array_equal(group["image"][:], records)
    np.testing.assert_array_equal(group["label"][:], labels)


def test_a_reader_keeps_the_version_it_opened(tmp_path: Path) -> None:
    records, labels = make_records(45), np.arange(45) % 3
    v1 = _write(tmp_path / "ds", records[:15], labels[:15])
    reader = open_dataset(tmp_path / "ds")  # opened before the commit, nothing read yet
    more = _write(tmp_path / "more", records[15:], labels[15:])
    commit(tmp_path / "ds", v1.meta, [_segment(more)], base=v1.meta, plan="p2", history={"operation": "append"})
    # The shard it holds half of, the field chunks and the documents were replaced; it reads its own.
    assert (tmp_path / "ds" / retired_key("image/c/1/0/0/0", v1.meta.shards[1].nbytes, v1.meta.shards[1].crc32c)).exists()
    np.testing.assert_array_equal(reader.payload.read_range(0, 15), records[:15])
    np.testing.assert_array_equal(reader.fields["label"], labels[:15])
    assert verify(tmp_path / "ds").ok
    with open_dataset(tmp_path / "ds") as now:
        np.testing.assert_array_equal(now.payload.read_range(0, 45), records)
    # An old version can be opened by number while it is kept.
    with open_dataset(tmp_path / "ds", version=1) as old:
        assert old.num_records == 15
        np.testing.assert_array_equal(old.read(np.arange(15))["image"], records[:15])
    assert [(v.number, v.records, v.current) for v in list_versions(tmp_path / "ds")] == [(1, 15, False), (2, 45, True)]


def test_pruned_versions_say_so(tmp_path: Path) -> None:
    records, labels = make_records(40), np.arange(40) % 3
    ds = _write(tmp_path / "ds", records[:5], labels[:5])
    reader = open_dataset(tmp_path / "ds")
    meta = ds.meta
    for v, (a, b) in enumerate([(5, 12), (12, 19), (19, 26)], start=2):
        more = _write(tmp_path / f"m{v}", records[a:b], labels[a:b])
        meta = commit(tmp_path / "ds", meta, [_segment(more)], base=meta, plan=f"p{v}", history={"operation": "append"},
                      keep_versions=1).meta
    # Versions 3 and 4 are kept (the current one and one older); 1 and 2 with their retired files are gone.
    assert [v.number for v in list_versions(tmp_path / "ds")] == [3, 4]
    retired = [p for p in (tmp_path / "ds" / VERSIONS_DIR / "retired").rglob("*") if p.is_file()]
    assert retired and all("@" in p.name for p in retired)
    with pytest.raises(VersionGoneError, match="reopen the dataset"):
        reader.payload.read_range(0, 5)
    with pytest.raises(DatasetNotFoundError, match="not kept"):
        open_dataset(tmp_path / "ds", version=1)
    with open_dataset(tmp_path / "ds") as now:
        np.testing.assert_array_equal(now.payload.read_range(0, 26), records[:26])


def test_running_a_finished_commit_again_changes_nothing(tmp_path: Path) -> None:
    records, labels = make_records(30), np.arange(30) % 3
    base = _write(tmp_path / "ds", records[:12], labels[:12])
    more = _write(tmp_path / "m", records[12:], labels[12:])
    first = commit(tmp_path / "ds", base.meta, [_segment(more)], base=base.meta, plan="p", history={"operation": "append"})
    before = {p: p.read_bytes() for p in (tmp_path / "ds").rglob("*") if p.is_file()}
    again = commit(tmp_path / "ds", base.meta, [_segment(more)], base=base.meta, plan="p", history={"operation": "append"})
    assert again.already_committed and again.meta == first.meta
    assert {p: p.read_bytes() for p in (tmp_path / "ds").rglob("*") if p.is_file()} == before
    # A commit planned on the old version is refused once another one came first.
    with pytest.raises(ConversionError, match="another commit came first"):
        commit(tmp_path / "ds", base.meta, [_segment(more)], base=base.meta, plan="other", history={"operation": "append"})


def test_a_damaged_source_is_refused_not_repacked(tmp_path: Path) -> None:
    records, labels = make_records(25), np.arange(25) % 3
    base = _write(tmp_path / "ds", records[:13], labels[:13])
    more = _write(tmp_path / "m", records[13:], labels[13:])
    shard = more.payload.shard_path(0)
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (tmp_path / "ds").rglob("*") if p.is_file()}
    with pytest.raises(ChecksumError, match="records crc32c"):
        commit(tmp_path / "ds", base.meta, [_segment(more)], base=base.meta, plan="p", history={"operation": "append"})
    # The root document was not touched: readers still see version 1, whole.
    assert (tmp_path / "ds" / "zarr.json").read_bytes() == before[tmp_path / "ds" / "zarr.json"]
    assert verify(tmp_path / "ds").ok and open_dataset(tmp_path / "ds").num_records == 13


def test_recipes_link_aligned_shards_and_repack_one_per_boundary(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)

    def stored(name: str, count: int, capacity: int = S) -> StoredShard:
        return StoredShard(store, name, count, capacity, 1, 0, 0, 0)

    def seg(*shards: StoredShard) -> Segment:
        return Segment(sum(s.count for s in shards), shards, dict)

    # Segment 1: 10 + 10 + 4 records (aligned at 0); segment 2 starts at 24: its pieces are a head of
    # 6 (filling shard 2), two whole shards under their final names, and a tail of 3.
    one = seg(stored("x0", 10), stored("x1", 10), stored("x2", 4))
    two = seg(stored("h", 6, 6), stored("image/c/3/0/0/0", 10), stored("image/c/4/0/0/0", 10), stored("t", 3))
    recipes = plan_shards(0, None, [one, two], S, store, "image", 4)
    assert [(r.start, r.stop) for r in recipes] == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 53)]
    # The tail is the dataset's last shard as it is (S index entries, 3 records): linked, not copied.
    assert [r.link for r in recipes] == [True, True, False, False, False, True]
    assert [r.in_place for r in recipes] == [False, False, False, True, True, False]
    assert [[(p[0].key, p[1], p[2]) for p in r.pieces] for r in recipes if not (r.link or r.in_place)] == [
        [("x2", 0, 4), ("h", 0, 6)]]


def test_label_names_extend_and_values_follow() -> None:
    labels, remaps = merge_labels({"label": ["cat", "dog"]}, [{"label": ["bird", "dog"]}, {"label": ["cat"]}])
    assert labels == {"label": ["cat", "dog", "bird"]}
    assert remaps[0]["label"].tolist() == [2, 1] and remaps[1] == {}


def test_new_class_names_extend_the_label_list(tmp_path: Path) -> None:
    records = make_records(20)
    base = _write(tmp_path / "ds", records[:10], np.array([0, 1] * 5), names=("cat", "dog"))
    # The new data calls its classes ["bird", "dog"]: "dog" keeps index 1, "bird" becomes 2; -1 stays -1.
    more = _write(tmp_path / "m", records[10:], np.array([0, 1, -1, 0, 1, 0, 1, 0, 1, 0]), names=("bird", "dog"))
    commit(tmp_path / "ds", base.meta, [_segment(more)], base=base.meta, plan="p", history={"operation": "append"})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.label_names == ["cat", "dog", "bird"]
        assert ds.fields["label"][10:].tolist() == [2, 1, -1, 2, 1, 2, 1, 2, 1, 2]
        assert ds.fields["label"][:10].tolist() == [0, 1] * 5


def test_aligned_segments_are_linked_not_copied(tmp_path: Path) -> None:
    records, labels = make_records(40), np.arange(40) % 3
    a = _write(tmp_path / "a", records[:20], labels[:20])
    b = _write(tmp_path / "b", records[20:], labels[20:])
    report = commit(tmp_path / "m", a.meta.with_(source={}, labels={}), [_segment(a), _segment(b)], base=None,
                    plan="m", history={"operation": "merge"})
    assert (report.shards_linked, report.shards_repacked, report.bytes_repacked) == (4, 0, 0)
    for i in range(4):
        src = (a if i < 2 else b).payload.shard_path(i % 2)
        assert os.path.samefile(tmp_path / "m" / f"image/c/{i}/0/0/0", src)  # a hard link: no bytes moved
    _write(tmp_path / "one", records, labels)
    _same_dataset(tmp_path / "m", tmp_path / "one")
    shutil.rmtree(tmp_path / "a")  # the merged dataset does not depend on its inputs
    assert verify(tmp_path / "m").ok


def test_a_commit_syncs_its_files_together_before_publishing_the_root_document(tmp_path: Path, monkeypatch) -> None:
    # No fsync waits between the commit's files (one after the other they cost a journal commit each):
    # they are all written, then synced, and only then is the root document renamed into place.
    import shardkit.formats.commit as commit_module

    records, labels = make_records(23), np.arange(23) % 3
    base = _write(tmp_path / "a", records[:10], labels[:10])
    rest = _write(tmp_path / "b", records[10:], labels[10:])
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda s, d: (events.append("rename " + str(Path(d).relative_to(tmp_path / "a"))),
                                                    real_replace(s, d))[1])
    monkeypatch.setattr(commit_module, "prune", lambda *a, **k: None)
    commit(tmp_path / "a", base.meta, [_segment(rest)], base=base.meta, plan="p", history={"operation": "append"})
    root = events.index("rename zarr.json")
    version = events.index(f"rename {VERSIONS_DIR}/v000002.json")
    renames = [i for i, e in enumerate(events) if e.startswith("rename ") and not e.startswith(f"rename {VERSIONS_DIR}/retired")]
    first = renames[0]
    # Retired copies (the old bytes kept before they are replaced) are durable at once; nothing else is
    # synced until the version document is written.
    between = [e for e in events[first:version] if e == "fsync"]
    retired = sum(e.startswith(f"rename {VERSIONS_DIR}/retired") for e in events[first:version])
    assert len(between) <= 2 * retired
    assert events[version + 1 : root].count("fsync") >= len(renames) - 2
    assert verify(tmp_path / "a").ok
    _same_dataset(tmp_path / "a", tmp_path / "a")
