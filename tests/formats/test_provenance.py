"""The provenance field and input table: written with the dataset, read one chunk at a time, checked
like every other file, refused when the metadata lies about them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import ChecksumError, NotADatasetError
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats import checksums as checksums_module
from shardkit.formats.checksums import attributes_crc32c
from shardkit.formats.fields import read_field_rows
from shardkit.formats.provenance import ENDS_ARRAY, NAMES_ARRAY, PROVENANCE_FIELD, ProvenanceSpec
from shardkit.formats.spec import ATTRS_KEY, ZARR_JSON

COLUMNS = ("input", "part", "width")


def _write(path: Path, n: int = 30, names: list[str] | None = None) -> Path:
    names = names if names is not None else [f"dir/file {i} é.jpg" for i in range(n + 2)]
    spec = ProvenanceSpec(COLUMNS, "/corpus", names, summarize=lambda v: {"records": int(v.shape[0])})
    fields = {"label": FieldSpec((), "int64"), PROVENANCE_FIELD: spec.field_spec}
    with DatasetWriter(path, kind="test", payload="image", record=FieldSpec((2, 2, 3), "uint8"), fields=fields,
                       records_per_shard=8, field_chunk=7, provenance=spec) as w:
        keep = [i for i in range(n + 2) if i not in (3, 17)][:n]  # inputs 3 and 17 skipped
        prov = np.array([[i, 0, 100 + i] for i in keep], np.int64)
        w.write({"image": np.zeros((n, 2, 2, 3), np.uint8), "label": np.arange(n), PROVENANCE_FIELD: prov})
    return path


def _edit_attrs(path: Path, edit) -> None:
    doc = json.loads((path / ZARR_JSON).read_text())
    attrs = doc["attributes"][ATTRS_KEY]
    edit(attrs)
    attrs["attributes_crc32c"] = attributes_crc32c(attrs)  # a hostile tool recomputes the checksum
    (path / ZARR_JSON).write_text(json.dumps(doc))


def test_sources_round_trip_and_stay_out_of_training_fields(tmp_path: Path) -> None:
    path = _write(tmp_path / "ds")
    with open_dataset(path) as ds:
        assert set(ds.fields) == {"label"} and set(ds.read([0])) == {"image", "label", "key"}
        assert ds.field(PROVENANCE_FIELD).shape == (30, 3)
        for k in range(30):
            i = k + (k >= 3) + (k >= 16)
            src = ds.source(k)
            assert (src.input, src.name, src.values["width"]) == (i, f"dir/file {i} é.jpg", 100 + i)
            assert src.path == f"/corpus/dir/file {i} é.jpg"
        assert ds.provenance.changes == {"records": 30}
        # The table is not in the metadata's 'files' map (a reader that predates provenance would refuse it).
        assert not any(p.startswith(("provenance_", PROVENANCE_FIELD + "_")) for p in ds.meta.files)
    assert verify(path).ok


def test_a_lookup_reads_only_the_chunks_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "ds")
    with open_dataset(path) as ds:
        read: list[str] = []
        real = checksums_module.read_verified  # every local read of a dataset file (versioned reads too)

        def spy(p, digest, **kw):
            read.append(Path(p).relative_to(path).as_posix())
            return real(p, digest, **kw)

        monkeypatch.setattr(checksums_module, "read_verified", spy)
        ds.source(22)
    chunks = [p for p in read if not p.endswith(ZARR_JSON)]
    assert chunks == [f"{PROVENANCE_FIELD}/c/3/0", f"{ENDS_ARRAY}/c/0", f"{NAMES_ARRAY}/c/0"]
    rows = read_field_rows(path, "label", FieldSpec((), "int64"), 30, 7, None, 12, 16)
    assert rows.tolist() == [12, 13, 14, 15]


def test_verify_and_lookups_catch_a_damaged_table(tmp_path: Path) -> None:
    path = _write(tmp_path / "ds")
    chunk = path / NAMES_ARRAY / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[-5] ^= 0x10
    chunk.write_bytes(bytes(raw))
    report = verify(path)
    assert not report.ok and any(NAMES_ARRAY in p.path for p in report.problems)
    with open_dataset(path) as ds:
        assert ds.fields["label"].shape == (30,)  # training reads never touch the table
        with pytest.raises(ChecksumError, match=NAMES_ARRAY):
            ds.source(0)


@pytest.mark.parametrize("edit,match", [
    (lambda a: a["provenance"].update(field="label"), "must be a declared int64 field"),
    (lambda a: a["provenance"].update(columns=["part", "input", "width"]), "must start with"),
    (lambda a: a["provenance"]["inputs"].update(count="9"), "expected an integer"),
    (lambda a: a["provenance"]["inputs"].update(nbytes=2**70), "expected an integer in"),
    (lambda a: a["provenance"]["files"].pop(f"{NAMES_ARRAY}/c/0"), "need 4"),
    (lambda a: a["provenance"]["inputs"].update(nbytes=2**60, names_chunk=1), "need 1152921504606846979"),
    (lambda a: a["provenance"]["files"].update({f"{NAMES_ARRAY}/c/9": a["provenance"]["files"].pop(
        f"{NAMES_ARRAY}/c/0")}), "missing"),
    (lambda a: a["provenance"].update(files=[]), "expected a JSON object"),
])
def test_a_lying_provenance_block_is_refused_at_open(tmp_path: Path, edit, match: str) -> None:
    path = _write(tmp_path / "ds")
    _edit_attrs(path, edit)
    with pytest.raises(NotADatasetError, match=match):
        open_dataset(path)


def test_names_past_the_table_or_absurdly_long_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "ds", n=2, names=["a", "b", "x" * 70000, "d"])
    with open_dataset(path) as ds:
        assert ds.source(0).name == "a"
        with pytest.raises(NotADatasetError, match="names are at most"):
            ds.provenance.input_name(path, 2)
        with pytest.raises(IndexError):
            ds.provenance.input_name(path, 4)
        with pytest.raises(IndexError):
            ds.source(2)


def test_a_record_pointing_past_the_table_is_a_named_error(tmp_path: Path) -> None:
    names = ["a", "b", "c"]
    spec = ProvenanceSpec(COLUMNS, "/corpus", names)
    fields = {PROVENANCE_FIELD: spec.field_spec}
    with DatasetWriter(tmp_path / "ds", kind="test", payload="image", record=FieldSpec((1,), "uint8"), fields=fields,
                       provenance=spec) as w:
        w.write({"image": np.zeros((2, 1), np.uint8), PROVENANCE_FIELD: np.array([[0, 0, 1], [7, 0, 1]], np.int64)})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.source(0).name == "a"
        with pytest.raises(NotADatasetError, match="record 1 says it came from input 7, but the provenance table holds 3"):
            ds.source(1)
        with pytest.raises(NotADatasetError, match="record 1 says it came from input 7, but the provenance table holds 3"):
            ds.sources([0, 1])


def test_zarr_python_reads_the_provenance_arrays(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    path = _write(tmp_path / "ds")
    group = zarr.open_group(str(path), mode="r")
    assert {PROVENANCE_FIELD, NAMES_ARRAY, ENDS_ARRAY} <= set(group.array_keys())
    names, ends = group[NAMES_ARRAY][:].tobytes(), group[ENDS_ARRAY][:]
    assert names[ends[3] : ends[4]].decode() == "dir/file 4 é.jpg"
    assert group[PROVENANCE_FIELD][3].tolist() == [4, 0, 104]


def test_a_batch_of_keys_gets_its_sources_reading_only_the_chunks_it_needs(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "ds")
    with open_dataset(path) as ds:
        keys = ds.read([22, 5, 23, 5])["key"]  # a batch's keys, in batch order, one repeated
        read: list[str] = []
        real = checksums_module.read_verified

        def spy(p, digest, **kw):
            read.append(Path(p).relative_to(path).as_posix())
            return real(p, digest, **kw)

        monkeypatch.setattr(checksums_module, "read_verified", spy)
        got = ds.sources(keys)
        monkeypatch.undo()
        assert list(got) == [*COLUMNS, "name"]
        for j, k in enumerate(keys.tolist()):
            src = ds.source(k)
            assert {c: int(got[c][j]) for c in COLUMNS} == src.values and got["name"][j] == src.name
        assert set(ds.sources([]).keys()) == {*COLUMNS, "name"}
        with pytest.raises(IndexError, match=r"record 30 outside \[0, 30\)"):
            ds.sources([1, 30])
    # field chunks of 7 records: keys 5, 22, 23 need chunks 0 and 3 only; each input name one table chunk
    chunks = sorted(p for p in read if not p.endswith(ZARR_JSON) and p.startswith(PROVENANCE_FIELD + "/"))
    assert chunks == [f"{PROVENANCE_FIELD}/c/0/0", f"{PROVENANCE_FIELD}/c/3/0"]
    with DatasetWriter(tmp_path / "bare", kind="test", payload="image", record=FieldSpec((1,), "uint8")) as w:
        w.write({"image": np.zeros((2, 1), np.uint8)})
    with open_dataset(tmp_path / "bare") as ds:
        assert ds.sources([0, 1]) == {}
