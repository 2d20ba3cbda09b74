"""Image decoding and the fixed-size transform shared by every image corpus kind.

:func:`open_image` turns any file Pillow reads into an upright picture (EXIF orientation applied and
reported, bombs and truncation refused) and :func:`to_rgb` into correct RGB; :class:`ImageTransform`
scales and crops or pads it to a fixed frame, with :class:`Geometry` recording the exact mapping so
boxes can follow (docs/design.md §5).
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.options import Option, choice, count
from shardkit.errors import ConfigError, InputFileError

__all__ = [
    "DECODES",
    "DEFAULT_DECODE",
    "REDUCING_GAP",
    "IMAGE_COLUMNS",
    "COMPOSITED",
    "DEPTH_SCALED",
    "INTERPOLATIONS",
    "IMAGE_EXTENSIONS",
    "IMAGE_OPTIONS",
    "Geometry",
    "ImageTransform",
    "LoadedImage",
    "image_options",
    "open_image",
    "parse_hw",
    "to_rgb",
    "check_regular_file",
    "orient_boxes",
]

#: Interpolation names accepted by ``--interpolation`` (all antialiased when downscaling).
INTERPOLATIONS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
#: File extensions that class-folder scans treat as images.
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm", ".pnm"}
)
#: ``exact``: decode every pixel, then resize. ``fast``: decode JPEGs at a reduced DCT scale and reduce
#: other pictures by whole factors first, keeping at least :data:`REDUCING_GAP` times the resize target.
DECODES = ("exact", "fast")
#: The default decode: ``fast``, because its difference from ``exact`` stays far below the 40 dB PSNR
#: threshold on the bundled photographs and COCO boxes are identical (benchmarks/RESULTS.md, "Decoding
#: less"). A picture shrunk by less than twice the gap runs the same code either way.
DEFAULT_DECODE = "fast"
#: A fast decode keeps the picture at least this many times the size the final resize produces.
REDUCING_GAP = 2.0
#: Provenance columns of every image kind: stored size, EXIF orientation, what the colour conversion
#: did (:data:`COMPOSITED`, :data:`DEPTH_SCALED` bits) and the DCT scale a fast decode used (1 = none).
IMAGE_COLUMNS = ("width", "height", "orientation", "flags", "reduce")
#: Provenance flag: transparency was composited onto :data:`BACKGROUND`.
COMPOSITED = 1
#: Provenance flag: 16-bit or float samples were scaled to 8 bits.
DEPTH_SCALED = 2
#: Colour that transparent pixels are composited over, and padding colour.
BACKGROUND = (255, 255, 255)
PAD_VALUE = 0


def check_regular_file(path: Path) -> int:
    """Return the size of ``path`` or raise ``InputFileError`` (missing, unreadable, not a regular file:
    opening a FIFO would block, or empty)."""

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputFileError(str(path), "missing: file not found (or a broken symlink)") from None
    except OSError as exc:
        raise InputFileError(str(path), f"unreadable: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "directory" if stat.S_ISDIR(st.st_mode) else "special file (fifo, socket or device)"
        raise InputFileError(str(path), f"unreadable: not a regular file but a {what}")
    if st.st_size == 0:
        raise InputFileError(str(path), "empty: zero-byte file")
    return st.st_size


@contextmanager
def _strict_pillow(max_pixels: int | None) -> Iterator[None]:
    from PIL import Image, ImageFile

    old_truncated = ImageFile.LOAD_TRUNCATED_IMAGES
    old_max = Image.MAX_IMAGE_PIXELS
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    if max_pixels is not None:
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = old_truncated
        Image.MAX_IMAGE_PIXELS = old_max


def open_image(path: Path, *, max_pixels: int | None = None) -> tuple[Any, int, tuple[int, int]]:
    """Decode ``path`` fully; returns the upright ``PIL.Image`` (any mode), the EXIF orientation applied
    (1 = none, reported so annotations can follow) and the stored ``(width, height)``.

    Pillow's bomb limit (``max_pixels``, ``None``: Pillow's default) is enforced at its warning
    threshold and truncated images are refused; every failure is an
    :class:`~shardkit.errors.InputFileError` whose reason starts with a category.
    """
    opened = _decode(path, max_pixels=max_pixels)
    return opened.image, opened.orientation, opened.stored_size


@dataclass(frozen=True)
class _Decoded:
    """A decoded upright picture, possibly at a reduced DCT scale.

    ``box`` is where the whole original picture lies in ``image``'s pixels (``(0, 0, w, h)`` at full
    scale; ``w / scale`` wide when reduced, which is not a whole number of pixels when the width is
    not a multiple of the scale).
    """

    image: Any
    orientation: int
    stored_size: tuple[int, int]
    scale: int
    box: tuple[float, float, float, float]


def _orientation(img: Any) -> int:
    try:
        orientation = int(img.getexif().get(0x0112, 1) or 1)
    except Exception:
        return 1
    return orientation if orientation in range(1, 9) else 1


def _upright(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """The upright ``(width, height)`` of a stored size (orientations 5 to 8 swap the axes)."""
    return (size[1], size[0]) if orientation >= 5 else size


def _decode(
    path: Path | str, *, max_pixels: int | None = None, want: Callable[[int, int], tuple[int, int]] | None = None,
    data: bytes | memoryview | None = None,
) -> _Decoded:
    """Decode ``path`` (or ``data``, the bytes of an image inside another file that ``path`` names) and
    apply its EXIF orientation; a JPEG at least twice the upright size ``want(width, height)`` asks for
    is decoded at the largest DCT scale (1/2, 1/4, 1/8) that gives it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if data is None:
        check_regular_file(Path(path))
    elif not len(data):
        raise InputFileError(str(path), "empty: zero-byte image")
    name = str(path)
    with _strict_pillow(max_pixels):
        try:
            with open(path, "rb") if data is None else io.BytesIO(data) as fh:
                img: Image.Image = Image.open(fh)
                stored = img.size
                box: tuple[float, float, float, float] = (0.0, 0.0, float(stored[0]), float(stored[1]))
                if want is not None and img.format == "JPEG":
                    # A JPEG's EXIF is parsed with its header; other formats may load pixels to find it.
                    orientation = _orientation(img)
                    need = _upright(want(*_upright(stored, orientation)), orientation)
                    if 2 * need[0] <= stored[0] and 2 * need[1] <= stored[1]:
                        drafted = img.draft(None, need)
                        if drafted is not None:
                            x0, y0, x1, y1 = drafted[1]
                            box = (float(x0), float(y0), float(x1), float(y1))
                img.load()
                orientation = _orientation(img)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise InputFileError(name, f"too-large: decompression bomb protection: {exc}") from None
        except UnidentifiedImageError:
            raise InputFileError(name, "unsupported: not an image format Pillow can read") from None
        except PermissionError as exc:
            raise InputFileError(name, f"unreadable: {exc.strerror or exc}") from None
        except OSError as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise InputFileError(name, f"truncated: {msg}") from None
            raise InputFileError(name, f"corrupt: {msg or type(exc).__name__}") from None
        except Exception as exc:
            raise InputFileError(name, f"corrupt: {type(exc).__name__}: {exc}") from None
    scale = max(1, round(stored[0] / box[2])) if box[2] > 0 else 1
    reduced = img.size
    if orientation != 1:
        img = ImageOps.exif_transpose(img)
        x0, y0, x1, y1 = orient_boxes(np.array([box]), orientation, *reduced)[0]
        box = (float(x0), float(y0), float(x1), float(y1))
    return _Decoded(img, orientation, stored, scale, box)


_Points = Callable[[np.ndarray, np.ndarray, float, float], tuple[np.ndarray, np.ndarray]]
#: EXIF orientation -> where the points ``(xs, ys)`` of a stored ``w x h`` image land once it is
#: shown upright: ``move(xs, ys, w, h) -> (xs', ys')``.
_ORIENTED_POINTS: dict[int, _Points] = {
    2: lambda x, y, w, h: (w - x, y),  # mirror
    3: lambda x, y, w, h: (w - x, h - y),  # rotate 180
    4: lambda x, y, w, h: (x, h - y),  # flip
    5: lambda x, y, w, h: (y, x),  # transpose
    6: lambda x, y, w, h: (h - y, x),  # rotate 90 clockwise
    7: lambda x, y, w, h: (h - y, w - x),  # transverse
    8: lambda x, y, w, h: (y, w - x),  # rotate 90 counter-clockwise
}


def orient_boxes(boxes: np.ndarray, orientation: int, width: int, height: int) -> np.ndarray:
    """Apply EXIF ``orientation`` (1-8) to ``[x0, y0, x1, y1]`` boxes of a stored ``width x height``
    image, mapping points as ``PIL.ImageOps.exif_transpose`` maps pixels."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    move = _ORIENTED_POINTS.get(orientation)  # None for 1 (as stored) and unknown values
    if move is None or b.shape[0] == 0:
        return b.copy()
    nx, ny = move(b[:, [0, 2]], b[:, [1, 3]], float(width), float(height))
    return np.stack([nx.min(axis=1), ny.min(axis=1), nx.max(axis=1), ny.max(axis=1)], axis=1)


def color_flags(img: Any) -> int:
    """What :func:`to_rgb` will do to ``img`` beyond a plain conversion (:data:`COMPOSITED`,
    :data:`DEPTH_SCALED`), for the provenance of the record."""
    mode = img.mode
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
        mode == "P" and ("transparency" in img.info or img.has_transparency_data)
    ):
        return COMPOSITED
    if mode.startswith("I;16") or mode in ("I", "F"):
        return DEPTH_SCALED
    return 0


def _composite(img: Any) -> Any:
    from PIL import Image

    rgba = img.convert("RGBA")
    base = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
    return Image.alpha_composite(base, rgba).convert("RGB")


def to_rgb(img: Any, path: str = "<image>") -> Any:
    """Convert a ``PIL.Image`` of any mode into correct RGB: alpha composited over :data:`BACKGROUND`
    (not dropped), 16-bit (and ``I``, clipped to 0..65535) scaled by 1/257, ``F`` read as 0..1
    intensities; other modes by Pillow's own conversions."""
    from PIL import Image

    mode = img.mode
    if mode == "RGB":
        return img
    if color_flags(img) == COMPOSITED:
        return _composite(img)
    if mode.startswith("I;16") or mode == "I":
        arr = np.asarray(img).astype(np.float64)
        gray = np.clip(np.rint(np.clip(arr, 0, 65535) / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(gray[:, :, None], 3, axis=2), "RGB")
    if mode == "F":
        arr = np.asarray(img).astype(np.float64)
        arr = np.nan_to_num(arr, nan=0.0, posinf=1.0, neginf=0.0)
        gray = np.clip(np.rint(np.clip(arr, 0.0, 1.0) * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(gray[:, :, None], 3, axis=2), "RGB")
    try:
        return img.convert("RGB")
    except (ValueError, OSError) as exc:
        raise InputFileError(path, f"unsupported: image mode {mode} cannot become RGB ({exc})") from None


@dataclass(frozen=True)
class Geometry:
    """How a source picture of ``(src_w, src_h)`` landed in the output frame.

    A source point ``(x, y)`` (upright picture) maps to ``(x * sx - off_x, y * sy - off_y)``;
    positive offsets are cut pixels, negative offsets are padding.
    """

    src_w: int
    src_h: int
    sx: float
    sy: float
    off_x: int
    off_y: int
    out_w: int
    out_h: int


@dataclass(frozen=True)
class ImageTransform:
    """The fixed-size transform: scale, then centre/crop or pad to ``(height, width)``.

    Parameters
    ----------
    height, width
        Output frame in pixels.
    resize
        ``"shorter"``: scale so the picture covers the frame (for a square frame its shorter side
        becomes the size); ``"longer"``: scale so it fits inside. Default: ``shorter`` with
        ``crop="center"``, ``longer`` with ``crop="pad"``.
    crop
        ``"center"``: centre the picture, cutting the excess / padding the shortfall equally on
        both sides. ``"pad"``: keep every pixel, anchored top-left, padded right/bottom (needs
        ``resize="longer"``).
    interpolation
        One of :data:`INTERPOLATIONS` (Pillow's antialiased filters).
    max_pixels
        Decompression-bomb limit; ``None`` keeps Pillow's default (about 89.5 Mpixel).
    decode
        ``"exact"``: decode every pixel, then resize; ``"fast"``: a picture shrunk a lot is decoded
        smaller first (JPEG DCT scaling, else ``Image.reduce``), at least :data:`REDUCING_GAP` times
        the target; boxes map exactly as with ``"exact"``.
    """

    height: int = 224
    width: int = 224
    resize: str = "shorter"
    crop: str = "center"
    interpolation: str = "bilinear"
    max_pixels: int | None = None
    decode: str = DEFAULT_DECODE

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ConfigError(f"ImageTransform: expected positive height and width, found {self.height}x{self.width}")
        if self.resize not in ("shorter", "longer"):
            raise ConfigError(f"ImageTransform: resize must be 'shorter' or 'longer', found {self.resize!r}")
        if self.crop not in ("center", "pad"):
            raise ConfigError(f"ImageTransform: crop must be 'center' or 'pad', found {self.crop!r}")
        if self.crop == "pad" and self.resize != "longer":
            raise ConfigError("ImageTransform: crop 'pad' keeps every pixel, so it needs resize 'longer'")
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(
                f"ImageTransform: interpolation must be one of {', '.join(INTERPOLATIONS)}, found {self.interpolation!r}"
            )
        if self.max_pixels is not None and self.max_pixels <= 0:
            raise ConfigError(f"ImageTransform: max_pixels must be positive, found {self.max_pixels}")
        if self.decode not in DECODES:
            raise ConfigError(f"ImageTransform: decode must be one of {', '.join(DECODES)}, found {self.decode!r}")

    @classmethod
    def from_options(
        cls, values: Mapping[str, Any], label: Callable[[str], str], default_size: int = 224
    ) -> ImageTransform:
        """Build from parsed :data:`IMAGE_OPTIONS` values; ``label`` names an option in errors."""
        h, w = values.get("size") or (default_size, default_size)
        crop = values.get("crop") or "center"
        resize = values.get("resize") or ("longer" if crop == "pad" else "shorter")
        if crop == "pad" and resize != "longer":
            raise ConfigError(
                f"{label('crop')} pad keeps every pixel, so it needs {label('resize')} longer "
                f"(found {label('resize')} {resize})"
            )
        return cls(h, w, resize, crop, values.get("interpolation") or "bilinear", values.get("max_pixels"),
                   values.get("decode") or DEFAULT_DECODE)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ImageTransform:
        """The transform a dataset's metadata records (``to_json``); ConfigError if it is not one.

        Metadata written before ``decode`` existed was decoded exactly.
        """
        try:
            return cls(int(doc["height"]), int(doc["width"]), str(doc["resize"]), str(doc["crop"]),
                       str(doc["interpolation"]), doc.get("max_pixels"), str(doc.get("decode", "exact")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an image transform: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["size"] = [self.height, self.width]
        d["background"] = list(BACKGROUND)
        d["pad_value"] = PAD_VALUE
        return d

    def geometry(self, src_w: int, src_h: int) -> Geometry:
        """Scale and offsets for a picture of ``(src_w, src_h)``."""
        ratio_w, ratio_h = self.width / src_w, self.height / src_h
        scale = max(ratio_w, ratio_h) if self.resize == "shorter" else min(ratio_w, ratio_h)
        new_w = max(1, int(round(src_w * scale)))
        new_h = max(1, int(round(src_h * scale)))
        if self.crop == "center":
            off_x = (new_w - self.width) // 2 if new_w >= self.width else -((self.width - new_w) // 2)
            off_y = (new_h - self.height) // 2 if new_h >= self.height else -((self.height - new_h) // 2)
        else:
            off_x = off_y = 0
        return Geometry(src_w, src_h, new_w / src_w, new_h / src_h, off_x, off_y, self.width, self.height)

    def apply(self, img: Any) -> tuple[np.ndarray, Geometry]:
        """Transform an upright RGB ``PIL.Image`` into a ``uint8 [H, W, 3]`` array."""
        return self._apply(img, img.size, None)

    def _decode_size(self, src_w: int, src_h: int) -> tuple[int, int]:
        """The smallest picture a fast decode may produce: :data:`REDUCING_GAP` x the resized size."""
        geo = self.geometry(src_w, src_h)
        new_w, new_h = int(round(geo.sx * src_w)), int(round(geo.sy * src_h))
        return int(np.ceil(new_w * REDUCING_GAP)), int(np.ceil(new_h * REDUCING_GAP))

    def _apply(self, img: Any, src: tuple[int, int], box: tuple[float, float, float, float] | None) -> tuple[np.ndarray, Geometry]:
        """Transform ``img``, which shows an upright picture of original size ``src`` in its region ``box``
        (the geometry comes from ``src``, so a reduced decode lands every pixel where the full one does)."""
        from PIL import Image

        resample = Image.Resampling[self.interpolation.upper()]
        geo = self.geometry(*src)
        new_w, new_h = int(round(geo.sx * geo.src_w)), int(round(geo.sy * geo.src_h))
        if self.decode == "fast":
            img = img.resize((new_w, new_h), resample, box=box, reducing_gap=REDUCING_GAP)
        elif (new_w, new_h) != img.size:
            img = img.resize((new_w, new_h), resample)
        if geo.off_x >= 0 and geo.off_y >= 0 and new_w - geo.off_x >= self.width and new_h - geo.off_y >= self.height:
            img = img.crop((geo.off_x, geo.off_y, geo.off_x + self.width, geo.off_y + self.height))
            out = np.asarray(img, dtype=np.uint8)
            if out.shape != (self.height, self.width, 3):  # defensive: Pillow returned something else
                out = np.ascontiguousarray(out.reshape(self.height, self.width, 3))
            return out, geo
        src_arr = np.asarray(img, dtype=np.uint8)
        out = np.full((self.height, self.width, 3), PAD_VALUE, dtype=np.uint8)
        # Source window [sx0, sx0+n) lands at destination [dx0, dx0+n).
        sx0, dx0 = max(geo.off_x, 0), max(-geo.off_x, 0)
        sy0, dy0 = max(geo.off_y, 0), max(-geo.off_y, 0)
        nx = min(new_w - sx0, self.width - dx0)
        ny = min(new_h - sy0, self.height - dy0)
        out[dy0 : dy0 + ny, dx0 : dx0 + nx] = src_arr[sy0 : sy0 + ny, sx0 : sx0 + nx]
        return out, geo

    def load(self, path: Path, data: bytes | memoryview | None = None) -> LoadedImage:
        """Decode ``path`` and transform it (``data``: the image's bytes, held inside the file ``path`` names)."""
        decoded = _decode(path, max_pixels=self.max_pixels, want=self._decode_size if self.decode == "fast" else None,
                          data=data)
        flags = color_flags(decoded.image)
        rgb = to_rgb(decoded.image, str(path))
        arr, geo = self._apply(rgb, _upright(decoded.stored_size, decoded.orientation), decoded.box)
        return LoadedImage(arr, geo, decoded.orientation, decoded.stored_size, flags, decoded.scale)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded, transformed image (``uint8 [H, W, 3]``) and how it got there: its :class:`Geometry`,
    the EXIF orientation applied (1 = none), the ``(width, height)`` stored before orientation, what
    the colour conversion did (:data:`COMPOSITED`, :data:`DEPTH_SCALED`) and the DCT scale (2, 4, 8, or 1)."""

    array: np.ndarray
    geometry: Geometry
    orientation: int
    stored_size: tuple[int, int]
    flags: int = 0
    scale: int = 1

    def provenance(self) -> dict[str, int]:
        """The record's :data:`IMAGE_COLUMNS`."""
        return {"width": self.stored_size[0], "height": self.stored_size[1], "orientation": self.orientation,
                "flags": self.flags, "reduce": self.scale}


def parse_hw(size: Any, label: str = "size") -> tuple[int, int]:
    """``224`` / ``"224"`` / ``"224x320"`` / ``(224, 320)`` -> ``(height, width)``, both positive."""
    hw: tuple[Any, ...] | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        hw = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        hw = tuple(size)
    elif isinstance(size, str):
        parts = size.lower().strip().split("x")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            hw = (int(parts[0]), int(parts[-1]))
    if hw is None or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= _MAX_SIDE for v in hw):
        raise ConfigError(
            f"{label}: expected H or HxW in pixels from 1 to {_MAX_SIDE} (e.g. 224 or 224x320), found {size!r}"
        )
    return int(hw[0]), int(hw[1])


#: Largest output side: 64 Kpixel (a record of 65536 x 65536 x 3 bytes is already 12 GiB).
_MAX_SIDE = 65536


_IMAGE_COMMON = (
    Option("resize", str, None, "shorter: cover the frame; longer: fit inside it (default shorter, or longer "
           "with crop pad).", parse=choice("shorter", "longer"), metavar="MODE"),
    Option("crop", str, "center", "center: centre the picture, cutting/padding both sides; pad: keep every "
           "pixel, padding right and bottom.", parse=choice("center", "pad"), metavar="MODE"),
    Option("interpolation", str, "bilinear", f"Resampling filter: {', '.join(INTERPOLATIONS)}.",
           parse=choice(*INTERPOLATIONS), metavar="NAME"),
    Option("max_pixels", int, None, "Decompression-bomb limit in pixels (default Pillow's, about 89.5M).",
           parse=count(1), metavar="N"),
    Option("decode", str, DEFAULT_DECODE, "exact: decode every pixel, then resize; fast: decode JPEGs at 1/2, 1/4 "
           "or 1/8 scale and reduce other pictures by whole factors first when they are shrunk by more than "
           f"{REDUCING_GAP:g}x.", parse=choice(*DECODES), metavar="MODE"),
)


def image_options(size_help: str = "Output frame H or HxW in pixels (default 224).") -> tuple[Option, ...]:
    """The options of every image kind (``size_help`` says what the kind does without ``size``)."""
    return (Option("size", str, None, size_help, parse=parse_hw, metavar="HxW"), *_IMAGE_COMMON)


#: Options of every image kind, with the default frame of 224 x 224.
IMAGE_OPTIONS = image_options()
