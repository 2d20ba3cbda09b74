"""COCO end to end: box mapping by hand, contiguous categories, every bad entry skipped with its reason."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset
from tests.helpers.corpora import coco_doc, natural_image, save_jpeg, write_json

# Image 1 is 200 x 100 with these boxes [x, y, w, h] and original category ids.
BOXES = [[60, 20, 40, 40], [0, 0, 20, 20], [180, 0, 20, 100], [40, 10, 40, 50]]
CATS = [5, 90, 1, 1]
CATEGORIES = [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}, {"id": 5, "name": "airplane"}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco") / "coco"
    val = root / "val"
    save_jpeg(val / "a.jpg", natural_image(100, 200, 1))
    save_jpeg(val / "b.jpg", natural_image(60, 80, 2))
    save_jpeg(val / "c.jpg", natural_image(60, 80, 3))
    save_jpeg(val / "d.jpg", natural_image(60, 80, 4))
    save_jpeg(val / "sub" / "e.jpg", natural_image(64, 64, 5))
    save_jpeg(root / "outside.jpg", natural_image(64, 64, 6))
    os.symlink(root / "outside.jpg", val / "link.jpg")
    data = (val / "b.jpg").read_bytes()
    (val / "trunc.jpg").write_bytes(data[: len(data) // 2])
    images = [
        {"id": 1, "file_name": "a.jpg", "width": 200, "height": 100},
        {"id": 2, "file_name": "b.jpg", "width": 80, "height": 60},
        {"id": 3, "file_name": "../outside.jpg", "width": 64, "height": 64},
        {"id": 4, "file_name": str(root / "outside.jpg"), "width": 64, "height": 64},
        {"id": 5, "file_name": "link.jpg", "width": 64, "height": 64},
        {"id": 6, "file_name": "missing.jpg", "width": 64, "height": 64},
        {"id": 7, "file_name": "c.jpg", "width": 80, "height": 60},
        {"id": 7, "file_name": "d.jpg", "width": 80, "height": 60},
        {"id": 8, "file_name": "sub/e.jpg", "width": 64, "height": 64},
        {"id": 9, "file_name": "trunc.jpg", "width": 80, "height": 60},
        {"id": "x", "file_name": "f.jpg"},
    ]
    anns = [{"id": 100 + k, "image_id": 1, "category_id": c, "bbox": b, "area": b[2] * b[3],
             "iscrowd": int(k == 3)} for k, (b, c) in enumerate(zip(BOXES, CATS))]
    anns += [{"id": 200 + k, "image_id": 8, "category_id": 1, "bbox": [k, k, 10, 10], "iscrowd": 0}
             for k in range(5)]
    anns += [
        {"id": 300, "image_id": 999, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 0},
        {"id": 301, "image_id": 1, "category_id": 42, "bbox": [0, 0, 5, 5], "iscrowd": 0},
        {"id": 302, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5], "iscrowd": 0},
        {"id": 303, "image_id": 7, "category_id": 1, "bbox": [0, 0, 5, 5], "iscrowd": 0},
    ]
    write_json(root / "annotations" / "instances_val.json", coco_doc(images, anns, CATEGORIES))
    return root


def _skips(ds) -> dict[str, str]:
    return {s.path: s.reason.split(":")[0] for s in ds.meta.skipped}


def test_center_crop_boxes_and_skips(corpus: Path, tmp_path: Path) -> None:
    s = shardkit.convert(corpus, tmp_path / "out", size=50, max_boxes=3, workers=1)
    assert s.kind == "coco" and s.records == 3
    assert s.notes == {"capped": 1}
    assert dict(s.skipped) == {"duplicate-id": 2, "malformed": 2, "missing": 1, "outside-corpus": 3,
                               "truncated": 1, "unknown-category": 1, "unknown-image": 1}
    with open_dataset(tmp_path / "out") as ds:
        f = ds.fields
        assert f["image_id"].tolist() == [1, 2, 8]
        assert ds.meta.labels["label"] == ["person", "airplane", "toothbrush"]
        assert ds.meta.extra["category_ids"] == [1, 5, 90]
        # Image 1: scale 0.5, 25 px cut left/right (hand-computed in test_boxes).
        assert f["num_boxes"].tolist() == [2, 0, 3]
        np.testing.assert_allclose(f["boxes"][0, :2], [[5, 10, 25, 30], [0, 5, 15, 30]])
        assert (f["boxes"][0, 2:] == 0).all() and (f["boxes"][1] == 0).all()
        assert f["box_labels"][0].tolist() == [1, 0, -1]
        assert f["iscrowd"][0].tolist() == [0, 1, 0]
        assert f["label"].tolist() == [1, -1, 0]  # largest box's label; -1 without boxes
        assert f["orig_size"].tolist() == [[100, 200], [60, 80], [64, 64]]
        skips = _skips(ds)
    assert skips[str(corpus / "val" / "../outside.jpg")] == "outside-corpus"
    assert skips[str(corpus / "outside.jpg")] == "outside-corpus"
    assert skips[str(corpus / "val" / "link.jpg")] == "outside-corpus"
    assert skips[str(corpus / "val" / "missing.jpg")] == "missing"
    assert skips[str(corpus / "val" / "c.jpg")] == skips[str(corpus / "val" / "d.jpg")] == "duplicate-id"


def test_pad_boxes(corpus: Path, tmp_path: Path) -> None:
    shardkit.convert(corpus, tmp_path / "pad", size=50, crop="pad", workers=1)
    with open_dataset(tmp_path / "pad") as ds:
        f = ds.fields
        assert f["boxes"].shape == (3, 100, 4)
        assert f["num_boxes"][0] == 4
        np.testing.assert_allclose(f["boxes"][0, :4], [[15, 5, 25, 15], [0, 0, 5, 5], [45, 0, 50, 25], [10, 2.5, 20, 15]])
        assert f["box_labels"][0, :4].tolist() == [1, 2, 0, 0]
        assert f["label"][0] == 0


def test_malformed_json_stops_naming_the_file(tmp_path: Path) -> None:
    root = tmp_path / "bad"
    (root / "val").mkdir(parents=True)
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_val.json").write_text('{"images": [')
    with pytest.raises(ConversionError, match=r"instances_val\.json: malformed JSON"):
        shardkit.convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_strict_stops_at_first_bad_entry(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="--strict"):
        shardkit.convert(corpus, tmp_path / "s", size=50, strict=True, workers=1)
