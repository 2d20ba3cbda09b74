"""Parquet and Hugging Face Parquet files as a corpus kind (issue 35, item 2): files written by pyarrow with
the schema metadata Hugging Face ``datasets`` writes (``{"huggingface": {"info": {"features": ...}}}``)
converted record by record; a missing column or a wrong type stops with the file and column named,
nothing already written lost."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import shardkit
from shardkit.errors import ConversionError, MissingExtraError
from shardkit.formats import open_dataset, verify
from tests.helpers.cli import run_cli
from tests.helpers.importers import png as _png
from tests.helpers.importers import random_image
from tests.helpers.importers import tree_digest as _digest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

H, W = 10, 14
_MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _image(seed: int) -> np.ndarray:
    return random_image(seed, H, W)


def _hf(table, features: dict):
    """``table`` with the schema metadata ``datasets``' ``Features.arrow_schema`` writes."""
    return table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})


_FEATURES = {"image": {"decode": True, "id": None, "_type": "Image"},
             "label": {"names": ["cat", "dog", "eel"], "id": None, "_type": "ClassLabel"},
             "caption": {"dtype": "string", "id": None, "_type": "Value"},
             "score": {"dtype": "float32", "id": None, "_type": "Value"}}


def _image_table(seeds: list[int]):
    return _hf(pa.table({
        "image": pa.array([{"bytes": _png(_image(s)), "path": f"{s}.png"} for s in seeds], type=_MEDIA),
        "label": pa.array([s % 3 for s in seeds], pa.int64()),
        "caption": [f"a picture {s}" for s in seeds],
        "score": pa.array([s / 2 for s in seeds], pa.float32()),
    }), _FEATURES)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A Hub-style layout: two train files (row groups of 3) and a test file."""
    root = tmp_path_factory.mktemp("pq") / "hub"
    (root / "data").mkdir(parents=True)
    pq.write_table(_image_table([0, 1, 2, 3, 4]), root / "data/train-00000-of-00002.parquet", row_group_size=3)
    pq.write_table(_image_table([5, 6, 7]), root / "data/train-00001-of-00002.parquet", row_group_size=3)
    pq.write_table(_image_table([8, 9]), root / "data/test-00000-of-00001.parquet")
    (root / "README.md").write_text("dataset card\n")
    return root, list(range(8))


def test_hugging_face_parquet_converts_record_by_record(hub, tmp_path: Path) -> None:
    root, seeds = hub
    s = shardkit.convert(root, tmp_path / "out", size=f"{H}x{W}", workers=2)
    assert s.kind == "parquet" and s.records == len(seeds) and s.num_skipped == 0
    assert s.notes == {"dropped column caption": len(seeds)}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.payload == "image" and ds.label_names == ["cat", "dog", "eel"]
        assert sorted(ds.fields) == ["label", "score"] and ds.meta.source["split"] == "train"
        for k, seed in enumerate(seeds):
            np.testing.assert_array_equal(ds[k]["image"], _image(seed))
            assert int(ds[k]["label"]) == seed % 3 and float(ds[k]["score"]) == seed / 2
            src = ds.source(k)
            file, row = ("train-00000-of-00002", k) if k < 5 else ("train-00001-of-00002", k - 5)
            assert src.name == f"data/{file}.parquet#{row}" and src.values["row"] == row
    assert verify(tmp_path / "out").ok
    test = shardkit.convert(root, tmp_path / "test", split="test", size=4, workers=1)
    assert test.records == 2


def test_raw_bytes_without_metadata_and_audio_structs(tmp_path: Path) -> None:
    pq.write_table(pa.table({"img": pa.array([_png(_image(i)) for i in range(3)], pa.binary()),
                             "label": pa.array([4, 0, 2], pa.int32())}), tmp_path / "raw.parquet")
    s = shardkit.convert(tmp_path / "raw.parquet", tmp_path / "out", size=f"{H}x{W}", workers=1)
    with open_dataset(tmp_path / "out") as ds:
        assert s.records == 3 and ds.label_names == ["0", "1", "2", "3", "4"]
        assert ds.fields["label"].tolist() == [4, 0, 2]
        np.testing.assert_array_equal(ds[1]["image"], _image(1))

    rate, clips = 8000, []
    for i in range(2):
        x = (np.sin(np.arange(rate // 4) * (i + 1) / 7) * 0.4).astype(np.float32)
        buf = io.BytesIO()
        sf.write(buf, x, rate, format="FLAC")
        clips.append(({"bytes": buf.getvalue(), "path": f"{i}.flac"}, x))
    table = _hf(pa.table({"audio": pa.array([c for c, _ in clips], type=_MEDIA), "label": pa.array([1, 0], pa.int64())}),
                {"audio": {"sampling_rate": rate, "_type": "Audio"}, "label": {"names": ["no", "yes"], "_type": "ClassLabel"}})
    pq.write_table(table, tmp_path / "speech.parquet")
    s = shardkit.convert(tmp_path / "speech.parquet", tmp_path / "audio", sample_rate=rate, duration=0.25, workers=1)
    with open_dataset(tmp_path / "audio") as ds:
        assert s.records == 2 and ds.meta.payload == "audio" and ds.label_names == ["no", "yes"]
        for k, (_, x) in enumerate(clips):
            want = np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int16)
            assert np.abs(ds[k]["audio"].astype(int) - want).max() <= 1  # FLAC keeps 16 bits
            assert ds.source(k).name == f"speech.parquet#{k}"


def test_a_missing_column_or_a_wrong_type_names_the_file_and_changes_nothing(hub, tmp_path: Path) -> None:
    root, _ = hub
    out = tmp_path / "out"
    shardkit.convert(root, out, size=4, workers=1)
    before = _digest(out)
    bad = tmp_path / "bad"
    (bad / "data").mkdir(parents=True)
    pq.write_table(_image_table([0, 1]), bad / "data/train-00000-of-00002.parquet")
    pq.write_table(_image_table([2]).drop_columns(["score"]), bad / "data/train-00001-of-00002.parquet")
    with pytest.raises(ConversionError, match=r"train-00001-of-00002\.parquet: missing column 'score'"):
        shardkit.convert(bad, tmp_path / "other", size=4, workers=1)
    r = run_cli("convert", str(bad), "-o", str(out), "--append", "--size", "4")
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    assert "train-00001-of-00002.parquet: missing column 'score'" in r.stderr
    assert _digest(out) == before

    t = _image_table([3])
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["dog"]))
    pq.write_table(t, bad / "data/train-00001-of-00002.parquet")
    with pytest.raises(ConversionError, match=r"train-00001-of-00002\.parquet: column 'label' is string, expected an integer"):
        shardkit.convert(bad, tmp_path / "other", size=4, workers=1)
    pq.write_table(pa.table({"image": pa.array([1, 2]), "label": pa.array([0, 1])}), bad / "wrong.parquet")
    with pytest.raises(ConversionError, match=r"wrong\.parquet: column 'image' is int64, expected a \{bytes, path\}"):
        shardkit.convert(bad / "wrong.parquet", tmp_path / "other", column="image", size=4, workers=1)
    assert _digest(out) == before


def test_bounded_row_groups_null_bytes_and_missing_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.parquet"
    table = pa.table({"image": pa.array([{"bytes": _png(_image(0)), "path": "a"}, {"bytes": None, "path": "b.png"}],
                                        type=_MEDIA), "label": pa.array([0, 1])})
    pq.write_table(table, path)
    s = shardkit.convert(path, tmp_path / "out", size=4, workers=1)
    assert s.records == 1 and dict(s.skipped_inputs) == {
        f"{path}#1": "missing: image holds no bytes (only the path 'b.png')"}
    with pytest.raises(ConversionError, match=r"a\.parquet: row group 0 holds \d+ bytes uncompressed, more than max_row_group_bytes 100"):
        shardkit.convert(path, tmp_path / "o2", size=4, max_row_group_bytes=100, workers=1)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ConversionError, match=r"junk\.parquet: not a readable Parquet file"):
        shardkit.convert(tmp_path / "junk.parquet", tmp_path / "o3", workers=1)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(MissingExtraError, match=r'pip install "shardkit\[parquet\]"'):
        shardkit.convert(path, tmp_path / "o4", size=4, workers=1)


def test_save_to_disk_arrow_files_are_read_memory_mapped(tmp_path: Path) -> None:
    """``DatasetDict.save_to_disk`` layout: ``<split>/data-0000N-of-0000M.arrow`` Arrow streams written
    with the features' schema (the ``huggingface`` metadata), next to JSON state files."""
    root = tmp_path / "saved"
    for split, seeds in (("train", [0, 1, 2, 3]), ("test", [4])):
        (root / split).mkdir(parents=True)
        table = _image_table(seeds)
        with pa.ipc.new_stream(root / split / "data-00000-of-00001.arrow", table.schema) as sink:
            for batch in table.to_batches(max_chunksize=3):
                sink.write_batch(batch)
        (root / split / "state.json").write_text("{}")
        (root / split / "dataset_info.json").write_text("{}")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    s = shardkit.convert(root, tmp_path / "out", size=f"{H}x{W}", workers=1)
    assert s.kind == "parquet" and s.records == 4
    with open_dataset(tmp_path / "out") as ds:
        assert ds.label_names == ["cat", "dog", "eel"] and ds.fields["label"].tolist() == [0, 1, 2, 0]
        for k in range(4):
            np.testing.assert_array_equal(ds[k]["image"], _image(k))
            assert ds.source(k).name == f"train/data-00000-of-00001.arrow#{k}"
