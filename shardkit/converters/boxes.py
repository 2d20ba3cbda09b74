"""Carry COCO boxes from the stored image into the output frame.

COCO boxes are ``[x, y, width, height]`` in pixels of the image *as stored* (the ``width`` and
``height`` of the image entry are the stored size). Two things move them: the EXIF orientation
that decoding applies, and the transform's scale and crop/pad offsets (:class:`Geometry`).
Coordinates are continuous (pixel edges), so a box covering the whole image maps to the whole
frame exactly.

After mapping, boxes are clipped to the frame; a box left with no area (it lay entirely in the cut
margin) is dropped, because a zero-area box is not an object a detector can learn from.
"""

from __future__ import annotations

import numpy as np

from shardkit.converters.images import Geometry, orient_boxes

__all__ = ["xywh_to_xyxy", "orient_boxes", "map_boxes"]


def xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """``[x, y, w, h]`` rows -> ``[x0, y0, x1, y1]`` rows (float64)."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.stack([b[:, 0], b[:, 1], b[:, 0] + b[:, 2], b[:, 1] + b[:, 3]], axis=1)


def map_boxes(boxes: np.ndarray, geo: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Map upright ``[x0, y0, x1, y1]`` boxes into the output frame and clip them.

    Returns
    -------
    mapped, keep
        ``float64 [n, 4]`` boxes in output pixels (clipped to ``[0, out_w] x [0, out_h]``) and a
        boolean mask of the boxes that still have a positive area.
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    out = np.empty_like(b)
    out[:, 0] = b[:, 0] * geo.sx - geo.off_x
    out[:, 2] = b[:, 2] * geo.sx - geo.off_x
    out[:, 1] = b[:, 1] * geo.sy - geo.off_y
    out[:, 3] = b[:, 3] * geo.sy - geo.off_y
    out[:, [0, 2]] = np.clip(out[:, [0, 2]], 0.0, float(geo.out_w))
    out[:, [1, 3]] = np.clip(out[:, [1, 3]], 0.0, float(geo.out_h))
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out, keep
