"""LitData optimized datasets made by litdata's own ``optimize`` (tests/data/litdata/make.py) convert record by
record into what litdata's StreamingDataset decodes (without litdata or torch installed); chunks and
indexes that lie are refused or skipped with the file named, a pickle leaf is never loaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters import registry
from shardkit.converters.litdata import leaf_names, litdata_column, unframe
from shardkit.converters.rowshards import column_array
from shardkit.errors import ConversionError, InputFileError
from shardkit.formats import open_dataset
from tests.helpers.cli import run_cli
from tests.helpers.rowshards import Fixtures, index
from tests.helpers.rowshards import litdata_rows as rows_of

_FIXTURES = Fixtures("litdata")
DATA = _FIXTURES.data
copy, expected = _FIXTURES.copy, _FIXTURES.expected


def test_every_item_becomes_its_record_in_order_with_provenance(tmp_path: Path) -> None:
    exp = expected("plain")
    assert registry.detect_kind(DATA / "plain") == "litdata"
    s = shardkit.convert(DATA / "plain", tmp_path / "out", workers=2)
    assert (s.kind, s.records, dict(s.skipped)) == ("litdata", 24, {})
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "image" and ds.meta.record.shape == (32, 32, 3)
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], exp["image"])
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])
        for k, (chunk, row) in enumerate(rows_of(DATA / "plain")):
            src = ds.source(k)
            assert src is not None and src.name == f"{chunk}#{row}" and src.values["row"] == row


def test_raw_pil_images(tmp_path: Path) -> None:
    shardkit.convert(DATA / "plain", tmp_path / "out", payload_column="pil", workers=1)
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], expected("plain")["pil"])


@pytest.mark.parametrize(("column", "shape", "dtype"), [
    ("arr", (2, 3), "float32"),  # numpy, with its header
    ("vec", (5,), "int16"),  # no_header_numpy
    ("t", (2, 3), "int16"),  # tensor, its big-endian header read without torch
    ("tv", (3,), "float64"),  # no_header_tensor
])
def test_arrays_and_tensors(tmp_path: Path, column: str, shape: tuple[int, ...], dtype: str) -> None:
    shardkit.convert(DATA / "plain", tmp_path / "out", payload_column=column, workers=1)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "array" and ds.meta.record.shape == shape and ds.meta.record.dtype == dtype
        np.testing.assert_array_equal(ds.read(np.arange(24))["array"], expected("plain")[column])


def test_text_and_bool_label_columns(tmp_path: Path) -> None:
    shardkit.convert(DATA / "plain", tmp_path / "cls", label_column="cls", workers=1)
    with open_dataset(tmp_path / "cls") as ds:
        assert ds.label_names == ["bird", "cat", "dog"]
        assert [ds.label_names[k] for k in ds.fields["label"]] == expected("plain")["cls"].tolist()
    shardkit.convert(DATA / "plain", tmp_path / "flag", label_column="flag", workers=1)
    with open_dataset(tmp_path / "flag") as ds:
        np.testing.assert_array_equal(ds.fields["label"], np.arange(24) % 2)


def test_zstd_chunks(tmp_path: Path) -> None:
    exp = expected("zstd")
    s = shardkit.convert(DATA / "zstd", tmp_path / "out", workers=2)
    assert s.kind == "litdata" and s.records == 24
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (24, 40, 3)
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], exp["image"])
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])  # the leaf named "target"


def test_a_zstd_chunk_that_expands_past_its_stated_size_is_refused(tmp_path: Path) -> None:
    import zstandard

    src = copy("zstd", tmp_path)
    doc = index(src)
    doc["config"]["compression_level"] = "chunk"  # whole chunks compressed: their stated size bounds inflation
    for c in doc["chunks"]:  # the same rows, as whole zstd chunks instead of frames
        classic = unframe((src / c["filename"]).read_bytes(), c["filename"])
        (src / c["filename"]).write_bytes(zstandard.ZstdCompressor().compress(classic))
        c["chunk_bytes"] = len(classic)
    (src / "index.json").write_text(json.dumps(doc))
    bomb = struct.pack("<I", 8) + bytes(50 << 20)  # the right row count, then 50 MiB of zeros
    (src / "chunk-0-1.bin").write_bytes(zstandard.ZstdCompressor().compress(bomb))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 16 and dict(s.skipped) == {"size": 8}
    assert s.skipped_inputs[0] == (f"{src / 'chunk-0-1.bin'}#0", f"size: decompresses to more than the "
                                   f"{doc['chunks'][1]['chunk_bytes']} bytes the index states")


def test_framed_zstd_chunks_whose_frame_table_lies(tmp_path: Path) -> None:
    src = copy("zstd", tmp_path)
    path = src / "chunk-0-1.bin"
    data = bytearray(path.read_bytes())
    assert data[:8] == b"LDFZ01\0\0"  # litdata's default with compression="zstd": frames of items
    n = struct.unpack_from("<I", data, 12)[0]
    table = 24 + 4 * (n + 1)
    struct.pack_into("<I", data, table + 20, struct.unpack_from("<I", data, table + 20)[0] + 1)  # frame 0 inflated +1
    path.write_bytes(bytes(data))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 16 and dict(s.skipped) == {"corrupt": 8}
    assert s.skipped_inputs[0][0] == f"{path}#0" and s.skipped_inputs[0][1].startswith("corrupt: frame 0 (items 0..8, ")


def test_a_pickle_leaf_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(ConversionError, match=r"column 'obj' \(pickle\) is pickled; shardkit never unpickles"):
        shardkit.convert(DATA / "pickle", tmp_path / "out", workers=1)
    r = run_cli("convert", str(DATA / "pickle"), "-o", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr and "is pickled" in r.stderr


def test_an_index_that_claims_too_many_items_is_refused_before_reading(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    doc = index(src)
    doc["chunks"][0]["chunk_size"] = 2**31
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"index\.json \(chunk 0\): states 2147483648 items in \d+ bytes; their "
                                              r"offsets alone need 8589934600 bytes"):
        shardkit.convert(src, tmp_path / "out", workers=1)
    doc["chunks"][0]["chunk_size"] = -1
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"expected chunk_size from 0 to 4294967295, found -1"):
        shardkit.convert(src, tmp_path / "out", workers=1)


def test_truncated_and_missing_chunks(tmp_path: Path) -> None:
    exp = expected("plain")
    src = copy("plain", tmp_path)
    data = (src / "chunk-0-1.bin").read_bytes()
    (src / "chunk-0-1.bin").write_bytes(data[:100])
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 16 and dict(s.skipped) == {"truncated": 1}
    assert s.skipped_inputs[0] == (str(src / "chunk-0-1.bin"), f"truncated: 100 bytes, index.json states {len(data)}")
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(16))["image"], np.concatenate([exp["image"][:8], exp["image"][16:]]))
    (src / "chunk-0-1.bin").unlink()
    with pytest.raises(ConversionError, match=r"chunk-0-1\.bin.*missing: shard file not found"):
        shardkit.convert(src, tmp_path / "strict", workers=1, strict=True)
    (src / "chunk-0-1.bin").write_bytes(data)
    assert shardkit.convert(src, tmp_path / "strict", workers=1, strict=True).records == 24


def test_item_sizes_that_lie_skip_only_that_item(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    path = src / "chunk-0-0.bin"
    data = bytearray(path.read_bytes())
    begin = struct.unpack_from("<I", data, 4 + 4 * 2)[0]  # item 2
    struct.pack_into("<I", data, begin + 4 * 1, 9)  # its "int" leaf claims 9 bytes
    path.write_bytes(bytes(data))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 23 and dict(s.skipped) == {"size": 1}
    assert s.skipped_inputs[0] == (f"{path}#2", "size: column 'label' (int) holds 8 bytes, the row says 9")


def test_paths_stay_inside_and_unsupported_layouts_are_named(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    doc = index(src)
    doc["chunks"][2]["filename"] = "../../etc/passwd"
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"\(chunk 2\): shard file name '../../etc/passwd' leads outside"):
        shardkit.convert(src, tmp_path / "out", workers=1)
    for key, value, message in [("compression_level", "sample", "compression_level 'sample'"),
                                ("encryption", {"level": "chunk"}, "encrypted"),
                                ("item_loader", "TokensLoader", "item_loader 'TokensLoader'"),
                                ("compression", "lz4", "compressed with 'lz4'")]:
        doc = index(DATA / "plain")
        doc["config"][key] = value
        (src / "index.json").write_text(json.dumps(doc))
        with pytest.raises(ConversionError, match=message):
            shardkit.convert(src, tmp_path / "out", workers=1)


def test_arrow_footer_chunks_are_refused_by_name(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    path = src / "chunk-0-2.bin"
    data = path.read_bytes()[:-8] + b"LDARW01\0"
    path.write_bytes(data)
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 16 and dict(s.skipped) == {"unsupported": 8}
    assert s.skipped_inputs[0][1] == "unsupported: a LitData Arrow-footer chunk, not rows shardkit reads"


def test_tensor_headers_in_either_byte_order_and_bounded_shapes() -> None:
    col = litdata_column("t", "tensor")
    values = np.arange(6, dtype="<i2")
    big = struct.pack(">II2I", 13, 2, 2, 3) + values.tobytes()  # int16, as LitData writes it now
    little = struct.pack("<II2I", 13, 2, 2, 3) + values.tobytes()  # as it wrote it before
    for raw in (big, little):
        np.testing.assert_array_equal(column_array(col, memoryview(raw), "c#0"), values.reshape(2, 3))
    huge = struct.pack(">II2I", 11, 2, 0xFFFFFFFF, 0xFFFFFFFF) + b"xx"
    with pytest.raises(InputFileError, match=r"size: an array of shape \[4294967295, 4294967295\] uint8 needs "
                                             r"18446744065119617025 bytes, the row holds 2"):
        column_array(col, memoryview(huge), "c#0")
    with pytest.raises(InputFileError, match="unsupported: tensor dtype number 10"):  # bfloat16
        column_array(col, memoryview(struct.pack(">II", 10, 0) + b"\0\0"), "c#0")
    with pytest.raises(InputFileError, match="at most 32 are allowed"):
        column_array(col, memoryview(struct.pack(">II", 11, 1000)), "c#0")


def test_pytree_specs_name_the_leaves() -> None:
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.dict", "context": json.dumps(["a", "b"]), "children_spec": [
        leaf, {"type": "builtins.tuple", "context": None, "children_spec": [leaf, leaf]}]}]
    assert leaf_names(json.dumps(spec), "index.json") == ["a", "b.0", "b.1"]
    assert leaf_names(json.dumps([1, leaf]), "index.json") == ["0"]
    with pytest.raises(ConversionError, match="a dict's keys do not match its children"):
        bad = [1, {"type": "builtins.dict", "context": json.dumps(["a"]), "children_spec": [leaf, leaf]}]
        leaf_names(json.dumps(bad), "index.json")


def test_audio_leaves_become_fixed_length_clips(tmp_path: Path) -> None:
    exp = expected("media")
    s = shardkit.convert(DATA / "media", tmp_path / "out", payload_column="audio", duration="500ms", workers=2)
    assert (s.records, dict(s.skipped)) == (8, {})
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "audio" and ds.meta.record.shape == (8000,) and ds.meta.record.dtype == "int16"
        np.testing.assert_array_equal(ds.read(np.arange(8))["audio"], exp["audio"])  # sample 3 zero-padded
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])
        for k, (chunk, row) in enumerate(rows_of(DATA / "media")):
            src = ds.source(k)
            assert src is not None and src.name == f"{chunk}#{row}" and src.values["row"] == row
            assert (src.values["rate"], src.values["channels"], src.values["frames"]) == (16000, 1, exp["frames"][k])
        assert ds.meta.transform["sample_rate"] == 16000
    # Cut into windows: one input, several records (the last window zero-padded).
    s = shardkit.convert(DATA / "media", tmp_path / "win", payload_column="audio", duration="250ms", window=True,
                         workers=1)
    assert s.records == sum(-(-int(n) // 4000) for n in exp["frames"])
    with open_dataset(tmp_path / "win") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(2))["audio"], exp["audio"][0].reshape(2, 4000))


def test_a_jpeg_array_leaf_is_one_stacked_record(tmp_path: Path) -> None:
    exp = expected("media")
    s = shardkit.convert(DATA / "media", tmp_path / "out", workers=1)  # the image list is the default record
    assert s.records == 8
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.source["payload_column"] == "views" and ds.meta.record.shape == (3, 16, 24, 3)
        np.testing.assert_array_equal(ds.read(np.arange(8))["image"], exp["views"])
