"""The bundled real corpora in datasets/: COCO, class-folder photos and recorded speech."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image, ImageOps
from scipy.signal import resample_poly

import shardkit
from shardkit.converters.images import ImageTransform
from shardkit.formats import open_dataset

DATASETS = Path(__file__).resolve().parents[2] / "datasets"


def _reference(path: Path, size: int) -> np.ndarray:
    """Independent re-implementation: exif_transpose, RGB, resize shorter side, centre crop."""
    img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    w, h = img.size
    s = max(size / w, size / h)
    nw, nh = round(w * s), round(h * s)
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real") / "coco"
    # The exact decode, which _reference re-implements pixel for pixel (test_decode_fast.py compares
    # the default fast decode with it).
    shardkit.convert(DATASETS / "coco", out, size=96, workers=2, decode="exact")
    return out


def test_real_coco(coco: Path) -> None:
    doc = json.loads((DATASETS / "coco" / "annotations" / "instances_val.json").read_text())
    images = {im["id"]: im for im in doc["images"]}
    cat_ids = sorted(c["id"] for c in doc["categories"])
    with open_dataset(coco) as ds:
        f = ds.fields
        assert ds.num_records == len(images) and ds.meta.extra["category_ids"] == cat_ids
        assert f["image_id"].tolist() == sorted(images)
        t = ImageTransform(96, 96)
        for k, image_id in enumerate(f["image_id"].tolist()):
            im = images[image_id]
            anns = [a for a in doc["annotations"] if a["image_id"] == image_id]
            geo = t.geometry(im["width"], im["height"])
            want = []
            for a in anns:
                x, y, w, h = a["bbox"]
                box = np.clip([x * geo.sx - geo.off_x, y * geo.sy - geo.off_y,
                               (x + w) * geo.sx - geo.off_x, (y + h) * geo.sy - geo.off_y], 0, 96)
                if box[2] > box[0] and box[3] > box[1]:
                    want.append((box, cat_ids.index(a["category_id"]), a["iscrowd"]))
            n = int(f["num_boxes"][k])
            assert n == len(want)
            for j, (box, lab, crowd) in enumerate(want):
                np.testing.assert_allclose(f["boxes"][k, j], box, atol=1e-4)
                assert f["box_labels"][k, j] == lab and f["iscrowd"][k, j] == crowd
            assert f["orig_size"][k].tolist() == [im["height"], im["width"]]
            if n == 0:
                assert f["label"][k] == -1
            image = ds.read([k])["image"][0]
            np.testing.assert_array_equal(image, _reference(DATASETS / "coco" / "val" / im["file_name"], 96))
        assert (f["num_boxes"] == 0).sum() >= 1 and f["iscrowd"].sum() >= 1


def test_real_imagefolder(tmp_path: Path) -> None:
    s = shardkit.convert(DATASETS / "imagefolder", tmp_path / "if", size=64, workers=2, decode="exact")
    assert s.num_skipped == 0
    root = DATASETS / "imagefolder" / "train"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    with open_dataset(tmp_path / "if") as ds:
        assert ds.label_names == sorted(p.name for p in root.iterdir())
        assert ds.num_records == len(files)
        for k, rel in enumerate(files):
            img = ds.read([k])["image"][0]
            np.testing.assert_array_equal(img, _reference(root / rel, 64), err_msg=rel)
            assert ds.fields["label"][k] == ds.label_names.index(rel.split("/")[0])
        wine = ds.read([files.index("object/wine.jpg")])["image"][0]
        grey = ds.read([files.index("object/grey.jpg")])["image"][0]
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    # Ignoring the EXIF tag would give a different (sideways) picture.
    raw = Image.open(root / "object" / "wine.jpg").convert("RGB")
    assert not np.array_equal(wine, ImageTransform(64, 64).apply(raw)[0])
    v = shardkit.convert(DATASETS / "imagefolder", tmp_path / "val", split="val", size=64, workers=1)
    assert v.records > 0 and v.num_skipped == 0


def test_real_speech(tmp_path: Path) -> None:
    root = DATASETS / "speech"
    listed = set()
    for name in ("validation_list.txt", "testing_list.txt"):
        listed |= set((root / name).read_text().split())
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.suffix in (".wav", ".flac") and p.relative_to(root).as_posix() not in listed)
    s = shardkit.convert(root, tmp_path / "sp", workers=2, dtype="float32", duration=1.5)
    assert s.records == len(files) and s.num_skipped == 0
    assert any(f.endswith(".flac") for f in files)
    with open_dataset(tmp_path / "sp") as ds:
        assert ds.meta.record.shape == (24000,)
        for k, rel in enumerate(files):
            orig, rate = sf.read(root / rel, dtype="float64")
            assert rate == 8000
            rec = ds.read([k])["audio"][0].astype(np.float64)
            n = 2 * len(orig)
            assert np.abs(rec[n + 8 :]).max() == 0  # zero padding after the clip
            back = resample_poly(rec[:n], 1, 2)
            corr = np.corrcoef(back[20:-20], orig[20:-20])[0, 1]
            assert corr > 0.99, (rel, corr)
            assert ds.label_names[ds.fields["label"][k]] == rel.split("/")[0]
    for split, name in (("validation", "validation_list.txt"), ("test", "testing_list.txt")):
        r = shardkit.convert(root, tmp_path / split, split=split, workers=1)
        assert r.records == len((root / name).read_text().split())
