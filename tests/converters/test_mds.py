"""MDS (MosaicML Streaming) datasets made by Streaming's own MDSWriter (tests/data/mds/make.py) convert record
by record into what Streaming's reader decodes; indexes and shards that lie are refused or skipped with
the file named, never unpickled, never read past what the file holds."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.converters import registry
from shardkit.converters.mds import mds_column
from shardkit.converters.rowshards import array_from, column_array, list_images
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import open_dataset
from tests.helpers.cli import run_cli
from tests.helpers.rowshards import Fixtures, index
from tests.helpers.rowshards import mds_rows as rows_of

_FIXTURES = Fixtures("mds")
DATA = _FIXTURES.data
copy, expected = _FIXTURES.copy, _FIXTURES.expected


def test_every_row_becomes_its_record_in_order_with_provenance(tmp_path: Path) -> None:
    exp = expected("plain")
    assert registry.detect_kind(DATA / "plain") == "mds"
    s = shardkit.convert(DATA / "plain", tmp_path / "out", workers=2)
    assert (s.kind, s.records, dict(s.skipped)) == ("mds", 24, {})
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "image" and ds.meta.record.shape == (32, 32, 3)  # the first image's size
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], exp["image"])
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])  # the column named "label"
        for k, (shard, row) in enumerate(rows_of(DATA / "plain")):
            src = ds.source(k)
            assert src is not None and src.name == f"{shard}#{row}" and src.values["row"] == row
            assert (src.values["width"], src.values["height"]) == (32, 32)
        assert ds.meta.source["payload_column"] == "image" and ds.meta.source["label_column"] == "label"


@pytest.mark.parametrize("column", ["png", "pil"])
def test_png_and_raw_pil_columns(tmp_path: Path, column: str) -> None:
    shardkit.convert(DATA / "plain", tmp_path / "out", payload_column=column, workers=1)
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], expected("plain")[column])


@pytest.mark.parametrize(("column", "shape", "dtype"), [("arr", (2, 3), "float32"), ("dyn", (2, 2), "int32"),
                                                        ("dt", (5,), "int16")])
def test_ndarray_columns_static_dynamic_and_dtype_only(tmp_path: Path, column: str, shape: tuple[int, ...], dtype: str) -> None:
    shardkit.convert(DATA / "plain", tmp_path / "out", payload_column=column, workers=1)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "array" and ds.meta.record.shape == shape and ds.meta.record.dtype == dtype
        np.testing.assert_array_equal(ds.read(np.arange(24))["array"], expected("plain")[column])
        assert ds.source(5) is not None and ds.source(5).values["row"] == rows_of(DATA / "plain")[5][1]


def test_text_and_number_label_columns(tmp_path: Path) -> None:
    exp = expected("plain")
    shardkit.convert(DATA / "plain", tmp_path / "cls", label_column="cls", workers=1)
    with open_dataset(tmp_path / "cls") as ds:
        assert ds.label_names == ["bird", "cat", "dog"]
        assert [ds.label_names[k] for k in ds.fields["label"]] == exp["cls"].tolist()
    shardkit.convert(DATA / "plain", tmp_path / "si", label_column="si", workers=1)
    with open_dataset(tmp_path / "si") as ds:
        np.testing.assert_array_equal(ds.fields["label"], exp["si"])
    with pytest.raises(ConfigError, match=r"label_column: column 'f' \(float64\) is not an integer or a text"):
        shardkit.convert(DATA / "plain", tmp_path / "f", label_column="f", workers=1)
    with pytest.raises(ConfigError, match=r"payload_column: no column 'nope' in .*index\.json; expected one of arr, "):
        shardkit.convert(DATA / "plain", tmp_path / "x", payload_column="nope", workers=1)


@pytest.mark.parametrize("algo", ["zstd", "gz"])
def test_compressed_shards(tmp_path: Path, algo: str) -> None:
    exp = expected(algo)
    s = shardkit.convert(DATA / algo, tmp_path / "out", workers=2)
    assert s.kind == "mds" and s.records == 24
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (24, 40, 3)
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], exp["image"])
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])  # the column named "class"
        assert ds.source(23).name == f"shard.00001.mds.{algo}#{rows_of(DATA / algo)[23][1]}"


def test_size_option_resizes(tmp_path: Path) -> None:
    shardkit.convert(DATA / "zstd", tmp_path / "out", size="16x20", workers=1)
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (16, 20, 3) and ds.meta.transform["size"] == [16, 20]


def test_a_split_directory(tmp_path: Path) -> None:
    shutil.copytree(DATA / "gz", tmp_path / "root" / "train")
    shutil.copytree(DATA / "zstd", tmp_path / "root" / "val")
    assert registry.detect_kind(tmp_path / "root") == "mds"
    s = shardkit.convert(tmp_path / "root", tmp_path / "out", split="val", workers=1)
    assert s.records == 24
    with open_dataset(tmp_path / "out") as ds:
        assert ds.source(0).path == str(tmp_path / "root" / "val" / "shard.00000.mds.zstd#0")


def test_a_pickle_column_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(ConversionError, match=r"pickle[/\\]index\.json: column 'obj' \(pkl\) is pickled; shardkit never "
                                              r"unpickles .* cannot be the payload"):
        shardkit.convert(DATA / "pickle", tmp_path / "out", workers=1)
    with pytest.raises(ConversionError, match=r"column 'obj' .* is pickled"):
        shardkit.convert(DATA / "pickle", tmp_path / "out", payload_column="obj", workers=1)


def test_an_index_that_claims_too_many_samples_is_refused_before_reading(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    doc = index(src)
    doc["shards"][0]["samples"] = 2**32 - 1  # offsets alone would be 16 GiB
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"index\.json \(shard 0\): states 4294967295 samples in 62802 bytes; "
                                              r"their offsets alone need 17179869188 bytes"):
        shardkit.convert(src, tmp_path / "out", workers=1)
    doc["shards"][0]["samples"] = 2**40
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"expected samples from 0 to 4294967295, found 1099511627776"):
        shardkit.convert(src, tmp_path / "out", workers=1)


def test_a_compressed_shard_claiming_billions_of_rows_costs_one_skip(tmp_path: Path) -> None:
    src = copy("zstd", tmp_path)
    doc = index(src)
    first, second = (s["samples"] for s in doc["shards"])
    doc["shards"][1]["samples"], doc["shards"][1]["raw_data"]["bytes"] = 2**31 - 100, 2**33 - 1
    (src / "index.json").write_text(json.dumps(doc))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == first and dict(s.skipped) == {"too-large": 1}
    # Within the size limit, the count the shard itself holds (its first decompressed bytes) decides.
    doc["shards"][1]["samples"], doc["shards"][1]["raw_data"]["bytes"] = 2**28 - 2, 2**30
    (src / "index.json").write_text(json.dumps(doc))
    s = shardkit.convert(src, tmp_path / "out2", workers=1)
    assert s.records == first and list(s.skipped_inputs) == [
        (str(src / "shard.00001.mds.zstd"), f"count: the shard holds {second} rows, index.json states {2**28 - 2}")]


def test_an_index_whose_counts_or_sizes_disagree_with_the_shard(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    doc = index(src)
    first, second = doc["shards"][0]["samples"], doc["shards"][1]["samples"]
    doc["shards"][0]["samples"] = first + 1
    (src / "index.json").write_text(json.dumps(doc))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    # shard 0 is skipped whole, its count read from its first bytes at scan; shard 1 converts
    assert s.records == second and dict(s.skipped) == {"count": 1}
    reasons = dict(s.skipped_inputs)
    assert reasons[str(src / "shard.00000.mds")] == f"count: the shard holds {first} rows, index.json states {first + 1}"
    doc["shards"][0]["samples"] = first
    doc["shards"][1]["raw_data"]["bytes"] -= 10
    (src / "index.json").write_text(json.dumps(doc))
    s = shardkit.convert(src, tmp_path / "out2", workers=1)
    assert s.records == first and dict(s.skipped) == {"size": 1}
    assert dict(s.skipped_inputs)[str(src / "shard.00001.mds")] == "size: 38216 bytes, index.json states 38206"
    doc["shards"][1]["samples"] = 0  # no shard left with a row: nothing to convert, said before anything is written
    doc["shards"][0]["raw_data"]["bytes"] += 10
    (src / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"index\.json: no shard has a readable row"):
        shardkit.convert(src, tmp_path / "out3", workers=1)


def test_a_truncated_or_missing_shard_is_skipped_and_strict_stops_naming_it(tmp_path: Path) -> None:
    exp = expected("plain")
    src = copy("plain", tmp_path)
    first = index(src)["shards"][0]["samples"]
    data = (src / "shard.00001.mds").read_bytes()
    (src / "shard.00001.mds").write_bytes(data[: len(data) // 2])
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == first and dict(s.skipped) == {"truncated": 1}
    assert s.skipped_inputs[0][0] == str(src / "shard.00001.mds")
    assert s.skipped_inputs[0][1] == f"truncated: {len(data) // 2} bytes, index.json states {len(data)}"
    with open_dataset(tmp_path / "out") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(first))["image"], exp["image"][:first])
    (src / "shard.00001.mds").unlink()
    with pytest.raises(ConversionError, match=r"shard\.00001\.mds.*missing: shard file not found"):
        shardkit.convert(src, tmp_path / "strict", workers=1, strict=True)
    # Nothing already written is lost: the shard back, the same command finishes the dataset.
    (src / "shard.00001.mds").write_bytes(data)
    s = shardkit.convert(src, tmp_path / "strict", workers=1, strict=True)
    assert s.records == 24
    with open_dataset(tmp_path / "strict") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(24))["image"], exp["image"])


def test_offsets_and_row_sizes_that_lie_skip_only_what_they_break(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    path = src / "shard.00000.mds"
    data = bytearray(path.read_bytes())
    n = struct.unpack_from("<I", data, 0)[0]
    begin = struct.unpack_from("<I", data, 4 + 4 * 3)[0]  # row 3
    # Row 3's first column size (the dynamic ndarray "dyn") claims 4 GiB.
    struct.pack_into("<I", data, begin, 0xFFFFFFFF)
    path.write_bytes(bytes(data))
    s = shardkit.convert(src, tmp_path / "out", workers=1)
    assert s.records == 23 and dict(s.skipped) == {"size": 1}
    assert s.skipped_inputs[0][0] == f"{path}#3" and "column sizes add up to" in s.skipped_inputs[0][1]
    # The last offset past the end of the file: every row of that shard is refused, nothing read past it.
    struct.pack_into("<I", data, 4 + 4 * n, len(data) + 1000)
    path.write_bytes(bytes(data))
    s = shardkit.convert(src, tmp_path / "out2", workers=1)
    assert s.records == 24 - n and dict(s.skipped) == {"offsets": n}


def test_paths_in_the_index_stay_inside_the_dataset(tmp_path: Path) -> None:
    for name in ("../outside.mds", "/etc/passwd"):
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(DATA / "plain", src)
        doc = index(src)
        doc["shards"][1]["raw_data"]["basename"] = name
        (src / "index.json").write_text(json.dumps(doc))
        with pytest.raises(ConversionError, match=r"index\.json \(shard 1\): shard file name .* (leads outside|is not a relative)"):
            shardkit.convert(src, tmp_path / "out", workers=1)


def test_dynamic_ndarray_shapes_are_checked_against_the_bytes_held() -> None:
    col = mds_column("x", "ndarray", None, "index.json")
    # uint8 values, 2 dims as uint64 (code 3): 2^40 x 2^40, followed by 4 bytes of values
    raw = bytes([8, (2 << 2) | 3]) + struct.pack("<2Q", 1 << 40, 1 << 40) + b"abcd"
    with pytest.raises(InputFileError, match=r"size: an array of shape \[1099511627776, 1099511627776\] uint8 needs "
                                             r"1208925819614629174706176 bytes, the row holds 4"):
        column_array(col, memoryview(raw), "shard#0")
    ok = bytes([17, (1 << 2) | 0, 2]) + np.array([-1, 7], "<i2").tobytes()
    np.testing.assert_array_equal(column_array(col, memoryview(ok), "shard#0"), np.array([-1, 7], np.int16))
    with pytest.raises(InputFileError, match="dtype code 99"):
        column_array(col, memoryview(bytes([99, 4, 1, 0])), "shard#0")
    with pytest.raises(ConversionError, match=r"states a fixed size of 8 bytes, the encoding has 24"):
        mds_column("a", "ndarray:float32:2,3", 8, "index.json")
    with pytest.raises(InputFileError, match="needs 24 bytes, the row holds 23"):
        array_from(memoryview(bytes(23)), "float32", (2, 3), "shard#1")


def test_cli_names_the_file_without_a_traceback(tmp_path: Path) -> None:
    src = copy("plain", tmp_path)
    doc = index(src)
    doc["shards"][0]["column_sizes"][0] = "many"
    (src / "index.json").write_text(json.dumps(doc))
    r = run_cli("convert", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "index.json (shard 0): expected a column size to be int, found \"many\"" in r.stderr
    r = run_cli("convert", str(DATA / "zstd"), "-o", str(tmp_path / "ok"), "--label-column", "class", "--size", "8")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("column", ["views", "masks", "raw", "frames"])
def test_an_image_list_of_fixed_length_is_one_stacked_record(tmp_path: Path, column: str) -> None:
    exp = expected("lists")
    s = shardkit.convert(DATA / "lists", tmp_path / "out", payload_column=column, workers=2)
    assert (s.records, dict(s.skipped)) == (8, {})
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "image" and ds.meta.record.shape == (3, 16, 24, 3)  # [N, H, W, 3]
        np.testing.assert_array_equal(ds.read(np.arange(8))["image"], exp[column])
        np.testing.assert_array_equal(ds.fields["label"], exp["label"])
        for k, (shard, row) in enumerate(rows_of(DATA / "lists")):
            src = ds.source(k)
            assert src is not None and src.name == f"{shard}#{row}" and src.values["row"] == row
            assert (src.values["width"], src.values["height"]) == (24, 16)


def test_an_image_list_is_resized_image_by_image_and_is_the_default_record(tmp_path: Path) -> None:
    s = shardkit.convert(DATA / "lists", tmp_path / "out", payload_column="views", size="8x12", workers=1)
    assert s.records == 8
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (3, 8, 12, 3) and ds.meta.transform["size"] == [8, 12]
    # No single image column: the first image list (by the index's order) is the record.
    shardkit.convert(DATA / "lists", tmp_path / "default", workers=1)
    with open_dataset(tmp_path / "default") as ds:
        assert ds.meta.source["payload_column"] == "frames" and ds.meta.record.shape == (3, 16, 24, 3)


def test_an_image_list_of_another_length_than_the_first_rows_is_skipped_with_its_reason(tmp_path: Path) -> None:
    counts = expected("lists")["ragged_counts"].tolist()
    assert counts[0] == 1 and set(counts) == {1, 2, 3}
    s = shardkit.convert(DATA / "lists", tmp_path / "out", payload_column="ragged", workers=1)
    rows = rows_of(DATA / "lists")
    assert s.records == counts.count(1) and dict(s.skipped) == {"count": 8 - counts.count(1)}
    assert list(s.skipped_inputs) == [
        (str(DATA / "lists" / shard) + f"#{row}", f"count: column 'ragged' holds {n} images, every record holds 1 "
                                                  "(the first row's count)")
        for (shard, row), n in zip(rows, counts) if n != 1]
    with pytest.raises(ConversionError, match=r"shard\.00000\.mds#1.*count: column 'ragged' holds 2 images"):
        shardkit.convert(DATA / "lists", tmp_path / "strict", payload_column="ragged", workers=1, strict=True)


def test_an_image_list_whose_count_or_sizes_lie_is_skipped_before_splitting(tmp_path: Path) -> None:
    col = mds_column("views", "list[jpeg]", None, "index.json")
    raw = struct.pack("<II", 0, 1 << 30) + b"\0" * 16  # a billion images claimed in 24 bytes
    with pytest.raises(InputFileError, match=r"size: an image list claims 1073741824 images in 24 bytes"):
        list_images(col, memoryview(raw), "shard#0")
    raw = struct.pack("<IIII", 0, 2, 5, 1 << 31) + b"\0" * 5
    with pytest.raises(InputFileError, match=r"size: the sizes of 2 images add up to 2147483669 bytes, the list holds 21"):
        list_images(col, memoryview(raw), "shard#0")
    arr = mds_column("frames", "jpeg_array", None, "index.json")  # no placeholder before the count
    assert [bytes(v) for v in list_images(arr, memoryview(struct.pack("<III", 2, 1, 2) + b"abc"), "s#0")] == [b"a", b"bc"]
