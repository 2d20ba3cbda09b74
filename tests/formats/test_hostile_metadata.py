"""Hostile or damaged metadata values give a named error before anything is allocated from them.

Issue 10 item 11 (second half): a record size of many GiB, zero or negative sizes, wrong JSON types,
absurd record counts and shard sizes, huge field shapes. Each edit recomputes every checksum that
covers the edited document, so what is tested is the validation of the *values*, not the checksum.
Each case also runs under tracemalloc: the error must come before any large allocation.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.cli.main import main
from shardkit.formats import PayloadArray, open_dataset
from shardkit.formats.checksums import FileDigest
from tests.helpers.datasets import edit_attributes, make_records, write_dataset

#: No case may allocate more than this while failing (the datasets here are a few KB).
PEAK_BYTES = 32 * 1024 * 1024


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda a: a.__setitem__(key, value)


def _shard0(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda a: a["shards"][0].__setitem__(key, value)


ATTRIBUTE_CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "record of many GiB": _set("record", {"shape": [2**20, 2**20, 3], "dtype": "uint8"}),
    "record of 2**70 bytes": _set("record", {"shape": [2**70], "dtype": "uint8"}),
    "record with a zero dimension": _set("record", {"shape": [0, 3, 3], "dtype": "uint8"}),
    "record with a negative dimension": _set("record", {"shape": [-4, 3, 3], "dtype": "uint8"}),
    "record shape as a string": _set("record", {"shape": "433", "dtype": "uint8"}),
    "record with 40 dimensions": _set("record", {"shape": [1] * 40, "dtype": "uint8"}),
    "object dtype": _set("record", {"shape": [4, 3, 3], "dtype": "object"}),
    "structured dtype": _set("record", {"shape": [4, 3, 3], "dtype": {"names": ["a"], "formats": ["u1"]}}),
    "num_records as a string": _set("num_records", "25"),
    "num_records as a bool": _set("num_records", True),
    "num_records as a float": _set("num_records", 25.0),
    "negative num_records": _set("num_records", -1),
    "absurd num_records": _set("num_records", 10**18),
    "zero records_per_shard": _set("records_per_shard", 0),
    "absurd records_per_shard": _set("records_per_shard", 2**40),
    "records_per_shard as a list": _set("records_per_shard", [10]),
    "huge field shape": lambda a: a["fields"].__setitem__("label", {"shape": [2**31], "dtype": "int64"}),
    "fields as a list": _set("fields", ["label"]),
    # 256 MiB a record (allowed) x 25 records in one chunk: a 6.4 GiB decode buffer (refused)
    "field chunk of many GiB": lambda a: a["fields"].__setitem__("label", {"shape": [2**25], "dtype": "int64"}),
    "zero field_chunk": _set("field_chunk", 0),
    "labels not lists": _set("labels", {"label": "abc"}),
    "shards not a list": _set("shards", {"0": {}}),
    "shard of negative size": _shard0("nbytes", -5),
    "shard of zero size": _shard0("nbytes", 0),
    "shard of many GiB": _shard0("nbytes", 2**40),
    "shard start as a string": _shard0("start", "0"),
    "shard crc out of range": _shard0("data_crc32c", 2**40),
    "shard path not a string": _shard0("path", 7),
    "shards not covering the records": lambda a: a["shards"].pop(),
    "compression as a string": _set("compression", "zstd"),
    "unknown compression": _set("compression", {"name": "lzma"}),
    "compression level as a string": _set("compression", {"name": "zstd", "level": "3"}),
    "format_version as a string": _set("format_version", "1"),
    "files as a list": _set("files", []),
    "file digest of negative size": lambda a: a["files"]["label/c/0"].__setitem__("nbytes", -1),
    "skipped entries not objects": _set("skipped", ["a.jpg"]),
    "kind as a number": _set("kind", 3),
}


def _open_and_load(path: Path) -> None:
    with open_dataset(path) as ds:
        ds.fields  # noqa: B018 - loading allocates from the metadata
        ds.payload.read([0, 24])


def _fails_small(path: Path, expected: type[Exception] = errors.NotADatasetError) -> Exception:
    tracemalloc.start()
    try:
        with pytest.raises(expected) as info:
            _open_and_load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"allocated {peak} bytes before failing"
    return info.value


@pytest.mark.parametrize("case", sorted(ATTRIBUTE_CASES))
def test_hostile_attribute_values_are_named_errors_before_allocation(dataset: Path, case: str) -> None:
    edit_attributes(dataset, ATTRIBUTE_CASES[case])
    exc = _fails_small(dataset, errors.ShardkitError)
    assert isinstance(exc, (errors.NotADatasetError, errors.CorruptShardError, errors.FormatVersionError)), exc
    assert str(dataset) in str(exc)


def _rewrite_document(dataset: Path, rel: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit an array document and record its new digest, so only the values are wrong."""
    doc_path = dataset / rel
    doc = json.loads(doc_path.read_text())
    edit(doc)
    raw = json.dumps(doc).encode()
    doc_path.write_bytes(raw)
    edit_attributes(dataset, lambda a: a["files"].__setitem__(rel, FileDigest.of(raw).to_json()))


def _sharding(doc: dict[str, Any]) -> dict[str, Any]:
    conf: dict[str, Any] = doc["codecs"][0]["configuration"]
    return conf


DOCUMENT_CASES: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "payload of 10**18 records": ("image/zarr.json", lambda d: d.__setitem__("shape", [10**18, 4, 3, 3])),
    "payload shape with strings": ("image/zarr.json", lambda d: d.__setitem__("shape", ["25", 4, 3, 3])),
    "payload record of many GiB": ("image/zarr.json", lambda d: (
        d.__setitem__("shape", [25, 2**20, 2**20, 3]),
        d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [10, 2**20, 2**20, 3]),
        _sharding(d).__setitem__("chunk_shape", [1, 2**20, 2**20, 3]))),
    "payload shard of 2**40 records": ("image/zarr.json", lambda d: (
        d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [2**40, 4, 3, 3]))),
    "payload chunk_grid as a number": ("image/zarr.json", lambda d: d.__setitem__("chunk_grid", 5)),
    "payload object dtype": ("image/zarr.json", lambda d: d.__setitem__("data_type", "object")),
    "payload codecs garbage": ("image/zarr.json", lambda d: d.__setitem__("codecs", "sharding")),
    "payload inner codecs garbage": ("image/zarr.json", lambda d: _sharding(d).__setitem__("codecs", [7])),
    "payload fill value garbage": ("image/zarr.json", lambda d: d.__setitem__("fill_value", {"x": 1})),
    "payload separator garbage": ("image/zarr.json", lambda d: d.__setitem__(
        "chunk_key_encoding", {"name": "default", "configuration": {"separator": "/../"}})),
    "field of 2**40 records": ("label/zarr.json", lambda d: d.__setitem__("shape", [2**40])),
    "field chunk of 2**40 records": ("label/zarr.json", lambda d: d["chunk_grid"]["configuration"].__setitem__(
        "chunk_shape", [2**40])),
    "field dtype not the declared one": ("label/zarr.json", lambda d: d.__setitem__("data_type", "float64")),
    "field shape as a dict": ("label/zarr.json", lambda d: d.__setitem__("shape", {"n": 25})),
    "field codecs unknown": ("label/zarr.json", lambda d: d.__setitem__(
        "codecs", [{"name": "bytes"}, {"name": "lzma"}])),
}


@pytest.mark.parametrize("case", sorted(DOCUMENT_CASES))
def test_hostile_array_documents_are_named_errors_before_allocation(dataset: Path, case: str) -> None:
    rel, edit = DOCUMENT_CASES[case]
    _rewrite_document(dataset, rel, edit)
    exc = _fails_small(dataset)
    assert rel in str(exc) or str(dataset) in str(exc)


def test_bare_zarr_array_with_an_absurd_shape_is_refused_before_allocation(dataset: Path) -> None:
    _rewrite_document(dataset, "image/zarr.json", lambda d: d.__setitem__("shape", [2**62, 2**30, 3, 3]))
    tracemalloc.start()
    try:
        with pytest.raises(errors.NotADatasetError, match=r"image/zarr\.json"):
            PayloadArray(dataset / "image")
        assert tracemalloc.get_traced_memory()[1] < PEAK_BYTES
    finally:
        tracemalloc.stop()


def test_huge_metadata_document_is_refused_without_reading_it(dataset: Path) -> None:
    doc = dataset / "zarr.json"
    with open(doc, "r+b") as fh:  # a sparse file: 2 GiB on paper, nothing on disk
        fh.truncate(2 * 1024**3)
    _fails_small(dataset)


def test_deeply_nested_json_is_a_named_error(dataset: Path) -> None:
    (dataset / "zarr.json").write_text("[" * 100_000 + "]" * 100_000)
    _fails_small(dataset)


@pytest.mark.parametrize("case", ["record of many GiB", "num_records as a string", "absurd records_per_shard",
                                  "shard of negative size", "huge field shape"])
def test_cli_gives_one_named_line_for_hostile_metadata(dataset: Path, case: str, capsys) -> None:
    edit_attributes(dataset, ATTRIBUTE_CASES[case])
    for cmd in ("info", "verify"):
        with pytest.raises(SystemExit) as code:
            main([cmd, str(dataset)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), err
        assert "internal error" not in err[0] and str(dataset) in err[0]


def test_valid_metadata_still_reads(dataset: Path) -> None:
    with open_dataset(dataset) as ds:
        np.testing.assert_array_equal(ds.payload.read([0, 24]), make_records(25)[[0, 24]])


def test_1_0_metadata_claiming_more_records_than_exist_fails_before_allocating_fields(tmp_path: Path) -> None:
    # Format 1.0 records no digests, so root and array documents can be edited consistently: they claim
    # 2**26 records (512 MiB of labels, 2 GiB of boxes). The field chunks that would hold them do not
    # exist, and that is found before the field arrays are allocated.
    import shutil

    path = tmp_path / "old"
    shutil.copytree(Path(__file__).parent / "golden" / "v1.0-plain", path)
    n = 2**26

    def claim(a: dict[str, Any]) -> None:
        a.update(num_records=n, records_per_shard=n)
        a["shards"] = [{"path": "image/c/0/0/0/0", "start": 0, "stop": n, "nbytes": n * 36 + n * 16 + 4, "crc32c": 0}]

    edit_attributes(path, claim)
    for rel, shape, chunk in (("image", [n, 4, 3, 3], [n, 4, 3, 3]), ("label", [n], [65536]), ("boxes", [n, 2, 4], [65536, 2, 4])):
        doc = json.loads((path / rel / "zarr.json").read_text())
        doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"] = shape, chunk
        (path / rel / "zarr.json").write_text(json.dumps(doc))
    tracemalloc.start()
    try:
        with open_dataset(path) as ds, pytest.raises(errors.MissingShardError, match=r"c/1\b.*missing"):
            ds.fields  # noqa: B018
        assert tracemalloc.get_traced_memory()[1] < PEAK_BYTES
    finally:
        tracemalloc.stop()
