"""Carry COCO boxes from the stored image into the output frame.

COCO boxes are ``[x, y, width, height]`` in pixels of the image *as stored*; the EXIF orientation and
the transform's scale and crop/pad (:class:`Geometry`) move them, on continuous coordinates (pixel
edges). Mapped boxes are clipped to the frame, and one left with no area is dropped.
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
    """Map upright ``[x0, y0, x1, y1]`` boxes into the output frame; returns them (``float64 [n, 4]``,
    clipped to ``[0, out_w] x [0, out_h]``) and the mask of those that still have a positive area."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    out = np.empty_like(b)
    out[:, [0, 2]] = np.clip(b[:, [0, 2]] * geo.sx - geo.off_x, 0.0, float(geo.out_w))
    out[:, [1, 3]] = np.clip(b[:, [1, 3]] * geo.sy - geo.off_y, 0.0, float(geo.out_h))
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out, keep
