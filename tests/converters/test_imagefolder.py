"""Class-folder images end to end: labels, splits, every bad input skipped with its reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import open_dataset, verify
from tests.helpers.corpora import make_imagefolder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("if") / "corpus"
    expected = make_imagefolder(root)
    return root, expected


def test_convert_train_split_with_bad_inputs(corpus, tmp_path: Path) -> None:
    root, expected = corpus
    summary = shardkit.convert(root, tmp_path / "out", size="24x32", workers=1)
    assert summary.kind == "imagefolder" and summary.records == 15
    want: dict[str, int] = {}
    for cat in expected.values():
        want[cat] = want.get(cat, 0) + 1
    assert dict(summary.skipped) == want
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.record.shape == (24, 32, 3)
        assert ds.label_names == ["cat", "dog", "eel"]
        assert ds.fields["label"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
        skipped = {Path(s.path).name: s.reason for s in ds.meta.skipped}
        assert {k: v.split(":")[0] for k, v in skipped.items()} == expected
        assert ds.meta.source["split"] == "train" and ds.meta.transform["size"] == [24, 32]
        assert ds.read([0])["image"].std() > 5
    assert verify(tmp_path / "out").ok


def test_val_split_uses_the_same_label_ids(corpus, tmp_path: Path) -> None:
    root, _ = corpus
    summary = shardkit.convert(root, tmp_path / "val", split="val", size=16, workers=1)
    assert summary.records == 10 and summary.num_skipped == 0
    with open_dataset(tmp_path / "val") as ds:
        assert ds.label_names == ["cat", "dog", "eel"]
        assert sorted(set(ds.fields["label"].tolist())) == [0, 1]


def test_unknown_split_and_kind_are_clear_errors(corpus, tmp_path: Path) -> None:
    root, _ = corpus
    with pytest.raises(ConfigError, match="available: train, val"):
        shardkit.convert(root, tmp_path / "x", split="nope")
    with pytest.raises(ConfigError, match="unknown corpus kind"):
        shardkit.convert(root, tmp_path / "x", kind="tfrecord")
    with pytest.raises(ConfigError, match="does not accept option"):
        shardkit.convert(root, tmp_path / "x", sample_rate=8000)


def test_strict_stops_naming_the_file(corpus, tmp_path: Path) -> None:
    root, expected = corpus
    with pytest.raises(ConversionError, match="--strict") as info:
        shardkit.convert(root, tmp_path / "s", size=16, workers=1, strict=True)
    first_bad = sorted(expected)[0]
    assert first_bad in str(info.value)
    with pytest.raises(shardkit.errors.IncompleteDatasetError):
        open_dataset(tmp_path / "s")  # never a partial dataset that looks complete


def test_interpolation_and_crop_options_change_the_output(corpus, tmp_path: Path) -> None:
    root, _ = corpus
    a = shardkit.convert(root, tmp_path / "a", split="val", size=16, interpolation="nearest", workers=1)
    b = shardkit.convert(root, tmp_path / "b", split="val", size=16, crop="pad", workers=1)
    with open_dataset(a.output) as da, open_dataset(b.output) as db:
        ia, ib = da.read([0])["image"][0], db.read([0])["image"][0]
        assert db.meta.transform["resize"] == "longer"
        assert not np.array_equal(ia, ib)
        assert (ib[-2:] == 0).all()  # landscape image padded at the bottom


def test_scan_and_input_names_make_no_path_object_per_input(tmp_path: Path) -> None:
    # The scan, the inputs' fingerprint and the provenance names run before and after the decode
    # workers, on one core: a pathlib Path made per input was most of their CPU. Paths made (calls of
    # pathlib's constructors) must not grow with the inputs (a few per class folder).
    import sys

    from shardkit.converters.imagefolder import ImageFolderConverter

    n = 600
    for i in range(n):
        folder = tmp_path / "src" / "train" / f"class{i % 3}" / ("sub" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.jpg").touch()
    (tmp_path / "src" / "train" / "class0" / "notes.txt").touch()
    conv = ImageFolderConverter(tmp_path / "src")
    calls = [0]

    def count(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code.co_filename.endswith("pathlib.py") and frame.f_code.co_name in (
                "__new__", "__init__", "_from_parts", "_from_parsed_parts", "with_segments"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        scan = conv.scan()
        conv.inputs_fingerprint(scan)
        names = list(conv.input_names(scan.items))
        paths = [conv.item_path(item) for item in scan.items]
    finally:
        sys.setprofile(None)
    assert len(names) == n + 1 and calls[0] < n // 10, calls[0]
    root = tmp_path / "src" / "train"
    assert paths == [str(root / rel) for rel, _ in scan.items]
    assert names[:2] == ["train/class0/0000.jpg", "train/class0/0006.jpg"] and "train/class1/sub/0001.jpg" in names
