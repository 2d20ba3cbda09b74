"""Decoding less (issue 15, item 1): a fast decode stays within the stated threshold of the exact one on
the real photographs, maps COCO boxes exactly, is the default, and gives the same bytes with any
number of workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import shardkit
from shardkit.converters.images import DEFAULT_DECODE, ImageTransform
from shardkit.formats import open_dataset
from tests.helpers.corpora import natural_image

DATASETS = Path(__file__).resolve().parents[2] / "datasets"
PHOTOS = sorted(DATASETS.rglob("*.jpg"))
#: The threshold the default was chosen by (benchmarks/convert.py, PSNR_THRESHOLD).
THRESHOLD_DB = 40.0


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_fast_is_the_default_and_within_the_threshold_on_every_real_photo() -> None:
    assert DEFAULT_DECODE == "fast" and ImageTransform().decode == "fast"
    reduced = 0
    for size in (32, 64, 96, 224):
        exact, fast = ImageTransform(size, size, decode="exact"), ImageTransform(size, size)
        for photo in PHOTOS:
            e, f = exact.load(photo), fast.load(photo)
            assert e.geometry == f.geometry, photo
            assert _psnr(e.array, f.array) >= THRESHOLD_DB, (photo, size)
            reduced += f.scale > 1
            if f.scale == 1:  # nothing to reduce: the very same bytes
                np.testing.assert_array_equal(e.array, f.array)
    assert reduced >= 80  # the fast path really ran (50 photos at 32, 33 at 64, 8 at 96 on this corpus)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_reduced_decodes_follow_the_exif_orientation(tmp_path: Path, orientation: int) -> None:
    # 457 is odd: at 1/2 scale the last column is half a pixel, which every orientation must put back
    # at the right edge of the original picture.
    img = Image.fromarray(natural_image(301, 457, 3))
    exif = img.getexif()
    exif[0x0112] = orientation
    img.save(tmp_path / "o.jpg", quality=95, exif=exif)
    for size in ((40, 40), (30, 50)):
        e = ImageTransform(*size, decode="exact").load(tmp_path / "o.jpg")
        f = ImageTransform(*size, decode="fast").load(tmp_path / "o.jpg")
        assert f.scale > 1 and e.geometry == f.geometry
        assert _psnr(e.array, f.array) >= THRESHOLD_DB


def test_other_formats_reduce_before_resizing(tmp_path: Path) -> None:
    Image.fromarray(natural_image(400, 600, 5)).save(tmp_path / "p.png")
    e = ImageTransform(48, 48, decode="exact").load(tmp_path / "p.png")
    f = ImageTransform(48, 48, decode="fast").load(tmp_path / "p.png")
    assert f.scale == 1 and e.geometry == f.geometry  # no DCT scale for a PNG: Image.reduce instead
    assert not np.array_equal(e.array, f.array) and _psnr(e.array, f.array) >= THRESHOLD_DB


def test_coco_boxes_and_fields_identical_and_workers_byte_identical(tmp_path: Path) -> None:
    for decode, workers in (("exact", 1), ("fast", 1), ("fast", 2)):
        shardkit.convert(DATASETS / "coco", tmp_path / f"{decode}{workers}", size=64, decode=decode,
                         workers=workers)
    with open_dataset(tmp_path / "exact1") as e, open_dataset(tmp_path / "fast1") as f:
        for name in e.fields:
            np.testing.assert_array_equal(e.fields[name], f.fields[name], err_msg=name)
        assert f.provenance.changes["reduced"] == {"count": 20, "max_scale": 2.0}  # every photo, at 1/2 scale
        assert e.provenance.changes["reduced"]["count"] == 0
        for k in range(len(e)):
            assert _psnr(e[k]["image"], f[k]["image"]) >= THRESHOLD_DB
    assert _files(tmp_path / "fast1") == _files(tmp_path / "fast2")
    with pytest.raises(shardkit.errors.ConfigError, match="decode"):
        shardkit.convert(DATASETS / "coco", tmp_path / "bad", decode="quick")
