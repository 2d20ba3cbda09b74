"""One malformed entry never aborts a conversion: it is a skip with a reason, or a named error under --strict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset
from tests.helpers.corpora import coco_doc, make_cifar10, make_cifar100, natural_image, save_jpeg, write_pickle

REPO = Path(__file__).resolve().parents[2]
DEEP = 100_000  # far beyond Python's recursion limit


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("malformed") / "coco"
    for k in range(1, 4):
        save_jpeg(root / "val" / f"{k}.jpg", natural_image(40, 60, k))
    images = [
        {"id": 1, "file_name": "1.jpg", "width": 60, "height": 40},
        {"id": 2, "file_name": "2.jpg"},
        {"id": 3, "file_name": "3.jpg", "width": 60, "height": 40},
        {"id": 2**70, "file_name": "1.jpg"},  # does not fit the int64 image_id field
        {"id": "4", "file_name": "1.jpg"},  # a string for a number
        {"id": 5, "file_name": 7},
        {"id": 6, "file_name": "2.jpg", "width": "60", "height": 40},
        ["1.jpg", 7],  # a list for an object
        {"id": 8, "file_name": "3.jpg", "extra": "@@DEEP@@"},  # nested too deeply to parse
    ]
    anns = [
        {"id": 10, "image_id": 1, "category_id": 1, "bbox": [1, 2, 10, 10], "iscrowd": 0},
        {"id": 11, "image_id": 1, "category_id": 1, "bbox": [5, 5, 10, 10], "iscrowd": "0"},  # "0" is truthy
        {"id": 12, "image_id": 1, "category_id": 1, "bbox": ["1", "2", "3", "4"]},
        {"id": 13, "image_id": 1, "category_id": 1, "bbox": [10**400, 0, 1, 1]},  # beyond float range
        {"id": 14, "image_id": 2**70, "category_id": 1, "bbox": [0, 0, 1, 1]},
        {"id": 15, "image_id": 1, "category_id": "1", "bbox": [0, 0, 1, 1]},
        {"id": 16, "image_id": 3, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": [1]},
        "not an annotation",
        {"id": 17, "image_id": 3, "category_id": 1, "bbox": [0, 0, 5, 5], "segmentation": "@@DEEP@@"},
        {"id": 18, "image_id": 3, "category_id": 2, "bbox": [2, 2, 20, 20], "iscrowd": 1},
    ]
    cats = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog", "supercategory": "animal"},
            {"id": 2**64, "name": "huge"}, {"id": 3, "name": "odd", "supercategory": {"x": 1}}, [3, "x"]]
    text = json.dumps(coco_doc(images, anns, cats)).replace('"@@DEEP@@"', _deep(DEEP))
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_val.json").write_text(text)
    return root


def test_malformed_coco_entries_are_skips_with_reasons(coco: Path, tmp_path: Path) -> None:
    s = shardkit.convert(coco, tmp_path / "out", size=32, workers=1)
    assert s.records == 3
    with open_dataset(tmp_path / "out") as ds:
        f = ds.fields
        assert f["image_id"].tolist() == [1, 2, 3]
        assert f["num_boxes"].tolist() == [1, 0, 1] and f["iscrowd"][2, 0] == 1
        assert ds.meta.extra["category_ids"] == [1, 2]
        reasons = {s.path.split("#")[-1]: s.reason for s in ds.meta.skipped}
    ann = "instances_val.json"

    def reason(where: str) -> str:
        matches = [v for k, v in reasons.items() if k == where or k.startswith(where + " ")]
        assert len(matches) == 1, (where, reasons)
        return matches[0]

    assert reason("images[3]").startswith(f"malformed: image entry needs an integer id (int64) and a file_name, found id {2**70}")
    assert reason("images[4]").startswith("malformed: image entry needs an integer id (int64)") and "found id '4'" in reason("images[4]")
    assert reason("images[5]").startswith("malformed: image entry") and "file_name 7" in reason("images[5]")
    assert reason("images[6]") == "malformed: width and height must be positive integers, found '60' x 40"
    assert reason("images[7]") == "malformed: expected an object, found list"
    assert reason("images[8]") == "malformed: holds a value nested more than 32 levels deep"
    assert reason("annotations[1]") == "malformed: iscrowd must be 0 or 1, found '0'"
    assert reason("annotations[2]").startswith("malformed: bbox must be [x, y, w, h]")
    assert reason("annotations[3]").startswith("malformed: bbox must be [x, y, w, h]")
    assert reason("annotations[4]") == f"malformed: annotation needs an integer image_id (int64), found {2**70}"
    assert reason("annotations[5]") == "malformed: annotation needs an integer category_id (int64), found '1'"
    assert reason("annotations[6]") == "malformed: iscrowd must be 0 or 1, found [1]"
    assert reason("annotations[7]") == "malformed: expected an object, found str"
    assert reason("annotations[8]") == "malformed: holds a value nested more than 32 levels deep"
    assert reason("categories[2]").startswith("malformed: category needs an integer id (int64)")
    assert reason("categories[3]").endswith("supercategory {'x': 1}")
    assert reason("categories[4]") == "malformed: expected an object, found list"
    assert all(ann in s.path for s in open_dataset(tmp_path / "out").meta.skipped)


def test_strict_stops_at_the_first_malformed_entry_naming_it(coco: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"instances_val\.json#categories\[2\]: malformed: .*--strict"):
        shardkit.convert(coco, tmp_path / "s", size=32, workers=1, strict=True)


@pytest.mark.parametrize("doc, message", [
    ('{"images": {"id": 1}}', "expected a COCO object with an 'images' list, found dict"),
    ('{"images": [], "annotations": {"a": 1}}', "expected 'annotations' and 'categories' to be lists, found dict"),
    (_deep(DEEP), "expected a COCO object with an 'images' list, found list"),
    ("[" * DEEP, "malformed JSON"),
    ('{"images": [' + "{" * 50, "malformed JSON"),
])
def test_an_unusable_annotation_file_is_a_named_error(tmp_path: Path, doc: str, message: str) -> None:
    (tmp_path / "c" / "val").mkdir(parents=True)
    (tmp_path / "c" / "annotations").mkdir()
    (tmp_path / "c" / "annotations" / "instances_val.json").write_text(doc)
    with pytest.raises(ConversionError, match=r"instances_val\.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        shardkit.convert(tmp_path / "c", tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_cli_names_the_error_without_a_traceback(coco: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(coco), "-o", str(tmp_path / "o"),
                        "--size", "32", "--strict", "-q"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert r.stderr.startswith("error: ") and "categories[2]: malformed" in r.stderr


def test_cifar_labels_outside_the_class_list_are_skips(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "c10", per_batch=6)
    d = tmp_path / "c10" / "cifar-10-batches-py"
    data = np.arange(6 * 3072, dtype=np.uint8).reshape(6, 3072)
    labels = [0, 10, -1, 2**70, "cat", 3.0]
    write_pickle(d / "data_batch_2", {b"data": data, b"labels": labels})
    s = shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=2)
    assert s.records == 30 - 5 and dict(s.skipped) == {"label": 5}
    with open_dataset(tmp_path / "out") as ds:
        # Each skip names its batch file and its index in that file, where a person finds it again.
        reasons = [(x.path.rsplit("/", 1)[1], x.reason) for x in ds.meta.skipped]
        np.testing.assert_array_equal(ds.read([6])["image"][0], data[0].reshape(3, 32, 32).transpose(1, 2, 0))
    assert reasons == [
        ("data_batch_2#1", "label: label 10 is not one of the 10 classes (expected 0..9)"),
        ("data_batch_2#2", "label: label -1 is not one of the 10 classes (expected 0..9)"),
        ("data_batch_2#3", f"label: label {2**70} is not one of the 10 classes (expected 0..9)"),
        ("data_batch_2#4", "label: label 'cat' is not one of the 10 classes (expected 0..9)"),
        ("data_batch_2#5", "label: label 3.0 is not one of the 10 classes (expected 0..9)"),
    ]
    with pytest.raises(ConversionError, match=r"data_batch_2#1: label: label 10 is not one of .*--strict"):
        shardkit.convert(tmp_path / "c10", tmp_path / "strict", workers=1, strict=True)


def test_cifar100_coarse_labels_are_checked_too(tmp_path: Path) -> None:
    make_cifar100(tmp_path / "c100", n=4)
    d = tmp_path / "c100" / "cifar-100-python"
    data = np.zeros((4, 3072), np.uint8)
    write_pickle(d / "train", {"data": data, "fine_labels": [1, 2, 3, 99], "coarse_labels": [0, 20, 19, 3]}, protocol=4)
    s = shardkit.convert(tmp_path / "c100", tmp_path / "out", workers=1)
    assert s.records == 3 and dict(s.skipped) == {"label": 1}
    with open_dataset(tmp_path / "out") as ds:
        assert ds.meta.skipped[0].reason == "label: coarse label 20 is not one of the 20 classes (expected 0..19)"
        assert ds.fields["coarse_label"].tolist() == [0, 19, 3]


@pytest.mark.parametrize("meta, message", [
    ({b"label_names": 7}, "expected label_names to be a list of names, found int"),
    ({b"label_names": [b"\xff\xfe"]}, "label_names holds a name that is not UTF-8"),
])
def test_unusable_cifar_meta_is_a_named_error(tmp_path: Path, meta: dict, message: str) -> None:
    make_cifar10(tmp_path / "c10")
    write_pickle(tmp_path / "c10" / "cifar-10-batches-py" / "batches.meta", meta)
    with pytest.raises(ConversionError, match=r"batches\.meta: " + message):
        shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)


def test_deeply_nested_pickles_are_a_named_error(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "c10")
    # A list nested 100000 deep, written by hand (pickle.dump itself would recurse): PROTO 2, that
    # many EMPTY_LIST, each APPENDed to the one below, STOP.
    (tmp_path / "c10" / "cifar-10-batches-py" / "data_batch_4").write_bytes(
        b"\x80\x02" + b"]" * DEEP + b"a" * (DEEP - 1) + b".")
    with pytest.raises(ConversionError, match=r"data_batch_4: .*nested"):
        shardkit.convert(tmp_path / "c10", tmp_path / "out", workers=1)
