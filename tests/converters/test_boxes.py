"""Box mapping: hand-computed values for resize+crop and resize+pad, EXIF orientations vs Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.converters.boxes import map_boxes, orient_boxes, xywh_to_xyxy
from shardkit.converters.images import ImageTransform, open_image

# A 200 x 100 (w x h) image and four COCO boxes [x, y, w, h].
BOXES = np.array([[60, 20, 40, 40], [0, 0, 20, 20], [180, 0, 20, 100], [40, 10, 40, 50]], float)


def test_resize_shorter_center_crop_by_hand() -> None:
    # scale = max(50/200, 50/100) = 0.5 -> 100 x 50; centre crop cuts 25 px left and right.
    geo = ImageTransform(50, 50, "shorter", "center").geometry(200, 100)
    mapped, keep = map_boxes(xywh_to_xyxy(BOXES), geo)
    assert keep.tolist() == [True, False, False, True]
    np.testing.assert_allclose(mapped[0], [60 * .5 - 25, 10, 100 * .5 - 25, 30])  # [5, 10, 25, 30]
    np.testing.assert_allclose(mapped[3], [0, 5, 15, 30])  # x0 = 20 - 25 clipped to 0


def test_resize_longer_pad_by_hand() -> None:
    # scale = min(50/200, 50/100) = 0.25 -> 50 x 25 at the top-left, padded below.
    geo = ImageTransform(50, 50, "longer", "pad").geometry(200, 100)
    mapped, keep = map_boxes(xywh_to_xyxy(BOXES), geo)
    assert keep.all()
    np.testing.assert_allclose(mapped, [[15, 5, 25, 15], [0, 0, 5, 5], [45, 0, 50, 25], [10, 2.5, 20, 15]])


def test_resize_longer_center_pad_by_hand() -> None:
    # 50 x 25 centred vertically: 12 rows of padding on top (offset -12).
    geo = ImageTransform(50, 50, "longer", "center").geometry(200, 100)
    mapped, _ = map_boxes(xywh_to_xyxy(BOXES[:1]), geo)
    np.testing.assert_allclose(mapped[0], [15, 17, 25, 27])


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_matches_pillow(tmp_path: Path, orientation: int) -> None:
    w, h = 90, 50
    box = np.array([[10, 5, 30, 15]], float)  # x, y, w, h in stored pixels
    arr = np.zeros((h, w), np.uint8)
    arr[5:20, 10:40] = 255
    img = Image.fromarray(arr, "L")
    exif = img.getexif()
    exif[0x0112] = orientation
    img.save(tmp_path / "o.png", exif=exif)
    up, got, stored = open_image(tmp_path / "o.png")
    assert got == orientation and stored == (w, h)
    a = np.asarray(up)
    ys, xs = np.nonzero(a > 127)
    x0, y0, x1, y1 = orient_boxes(xywh_to_xyxy(box), orientation, w, h)[0]
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x0, y0, x1, y1)
