"""A contact sheet of image records, drawn with Pillow alone: frames in a grid, captioned with key and
class, COCO boxes drawn with their class names. Frames are shown as stored (zoomed by a whole factor,
never smoothed); a box ``[x0, y0, x1, y1]`` covers pixels ``floor(x0)..ceil(x1) - 1`` (likewise y)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SheetLayout", "Tile", "BOX_COLORS", "contact_sheet", "as_rgb", "box_pixels"]

#: Outline colours by class id (colour-blind-safe Okabe-Ito palette, then a few more).
BOX_COLORS = (
    (230, 159, 0), (86, 180, 233), (0, 158, 115), (240, 228, 66), (0, 114, 178), (213, 94, 0),
    (204, 121, 167), (255, 255, 255), (255, 0, 255), (0, 255, 255),
)
_BACKGROUND = (32, 32, 32)
_TEXT = (240, 240, 240)
_CAPTION = 18
_MARGIN = 6
_LINE = 2


@dataclass(frozen=True)
class Tile:
    """Where one record landed on the sheet: its frame's top-left pixel and the zoom factor."""

    key: int
    x: int
    y: int
    zoom: int


@dataclass(frozen=True)
class SheetLayout:
    """The sheet's size and every tile (tests and callers locate records and boxes with it)."""

    width: int
    height: int
    tiles: tuple[Tile, ...]


def as_rgb(frame: np.ndarray) -> np.ndarray:
    """A record as ``uint8 [H, W, 3]``: grey and single-channel frames replicated, alpha dropped,
    other dtypes scaled from their range."""
    a = np.asarray(frame)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ValueError(f"expected an image record [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], found {a.shape}")
    if a.dtype != np.uint8:
        f = a.astype(np.float64)
        if a.dtype.kind == "f" and f.size and f.min() >= 0 and f.max() <= 1:
            f = f * 255
        elif a.dtype.kind in "iu" and a.dtype.itemsize > 1:
            f = (f - np.iinfo(a.dtype).min) * (255 / (np.iinfo(a.dtype).max - np.iinfo(a.dtype).min))
        a = np.clip(np.rint(f), 0, 255).astype(np.uint8)
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    return np.ascontiguousarray(a[:, :, :3])


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _fit(draw: Any, text: str, font: Any, width: int) -> str:
    """``text``, shortened with an ellipsis until it fits ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def _zoom(h: int, w: int) -> int:
    """Whole-number zoom so a small frame is at least about 128 pixels on its shorter side."""
    return max(1, 128 // max(1, min(h, w)))


def contact_sheet(
    frames: Sequence[np.ndarray],
    keys: Sequence[int],
    captions: Sequence[str],
    boxes: Sequence[tuple[np.ndarray, Sequence[int], Sequence[str]]] | None = None,
    *,
    columns: int | None = None,
) -> tuple[Any, SheetLayout]:
    """Draw a contact sheet of ``frames`` (one shape, any layout :func:`as_rgb` accepts) captioned with
    each record's ``keys`` and ``captions``, with ``boxes`` per record (``([M, 4] boxes, class ids,
    class names)`` or ``None``) and ``columns`` tiles per row (default: about square); returns the RGB
    ``PIL.Image`` and each tile's place."""
    from PIL import Image, ImageDraw

    if not frames:
        raise ValueError("no records to draw")
    rgb = [as_rgb(f) for f in frames]
    h, w = rgb[0].shape[:2]
    zoom = _zoom(h, w)
    cols = columns or max(1, math.ceil(math.sqrt(len(rgb))))
    rows = math.ceil(len(rgb) / cols)
    tile_w, tile_h = w * zoom, h * zoom + _CAPTION
    sheet = Image.new("RGB", (_MARGIN + cols * (tile_w + _MARGIN), _MARGIN + rows * (tile_h + _MARGIN)), _BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font, small = _font(13), _font(11)
    tiles = []
    for i, (frame, key, caption) in enumerate(zip(rgb, keys, captions)):
        x = _MARGIN + (i % cols) * (tile_w + _MARGIN)
        y = _MARGIN + (i // cols) * (tile_h + _MARGIN)
        pic = Image.fromarray(frame, "RGB")
        if zoom > 1:
            pic = pic.resize((w * zoom, h * zoom), Image.Resampling.NEAREST)
        sheet.paste(pic, (x, y))
        draw.text((x + 2, y + h * zoom + 2), _fit(draw, caption, font, tile_w - 4), fill=_TEXT, font=font)
        tiles.append(Tile(int(key), x, y, zoom))
        if boxes is not None:
            _draw_boxes(draw, boxes[i], x, y, zoom, (w, h), small)
    return sheet, SheetLayout(sheet.width, sheet.height, tuple(tiles))


def box_pixels(box: Sequence[float] | np.ndarray, frame: tuple[int, int]) -> tuple[int, int, int, int]:
    """First and last frame pixel ``(c0, r0, c1, r1)`` a box ``[x0, y0, x1, y1]`` covers (inclusive)."""
    w, h = frame
    c0, r0 = min(w - 1, max(0, math.floor(box[0]))), min(h - 1, max(0, math.floor(box[1])))
    c1, r1 = max(c0, min(w - 1, math.ceil(box[2]) - 1)), max(r0, min(h - 1, math.ceil(box[3]) - 1))
    return c0, r0, c1, r1


def _draw_boxes(draw: Any, entry: tuple[np.ndarray, Sequence[int], Sequence[str]], x: int, y: int, zoom: int,
                frame: tuple[int, int], font: Any) -> None:
    coords, classes, names = entry
    for box, cls, name in zip(np.asarray(coords, dtype=np.float64).reshape(-1, 4), classes, names):
        color = BOX_COLORS[int(cls) % len(BOX_COLORS)] if cls >= 0 else _TEXT
        c0, r0, c1, r1 = box_pixels(box, frame)
        outer = (x + c0 * zoom, y + r0 * zoom, x + (c1 + 1) * zoom - 1, y + (r1 + 1) * zoom - 1)
        draw.rectangle(outer, outline=color, width=_LINE)
        text = _fit(draw, name, font, max(8, outer[2] - outer[0] - 2))
        tw = int(draw.textlength(text, font=font)) + 4
        top = outer[1] + _LINE
        draw.rectangle((outer[0] + _LINE, top, outer[0] + _LINE + tw, top + 12), fill=color)
        draw.text((outer[0] + _LINE + 2, top), text, fill=(0, 0, 0), font=font)
