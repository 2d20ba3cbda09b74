"""What conversion did to each record, read back from its provenance (see :mod:`shardkit.formats.provenance`).

Everything is computed from the integers a decoder measured per record and the transform recorded in
the metadata, so it never disagrees with what was stored and works when the corpus is gone:
:func:`summarize` counts what conversion changed over the dataset (printed by :func:`change_lines`),
:func:`describe` says what was done to one record (``shardkit info PATH --record K``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardkit.converters.images import COMPOSITED, DEPTH_SCALED, ImageTransform
from shardkit.errors import ConfigError

__all__ = ["UPSCALE_LIMIT", "KEPT_LIMIT", "summarize", "describe", "change_lines"]

#: Images enlarged by more than this factor are counted as upscaled.
UPSCALE_LIMIT = 2.0
#: Crops that keep less than this fraction of the picture's area are counted.
KEPT_LIMIT = 0.5


def _columns(columns: Sequence[str], values: np.ndarray, names: Sequence[str]) -> list[np.ndarray] | None:
    """The columns ``names`` of ``values`` (``[N, C]``), or ``None`` when one is missing."""
    index = {c: i for i, c in enumerate(columns)}
    if any(n not in index for n in names):
        return None
    return [values[:, index[n]].astype(np.int64) for n in names]


def _count(mask: np.ndarray, extreme: np.ndarray | None = None, key: str = "", *, largest: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"count": int(mask.sum())}
    if key:
        out[key] = None if not mask.any() or extreme is None else float(
            np.max(extreme[mask]) if largest else np.min(extreme[mask]))
    return out


# ---------------------------------------------------------------------- images
def _image_geometry(t: ImageTransform, width: np.ndarray, height: np.ndarray,
                    orientation: np.ndarray) -> tuple[np.ndarray, ...]:
    """Vectorised :meth:`ImageTransform.geometry`: ``(src_w, src_h, new_w, new_h)`` per record."""
    upright = orientation >= 5
    src_w = np.where(upright, height, width).astype(np.float64)
    src_h = np.where(upright, width, height).astype(np.float64)
    src_w, src_h = np.maximum(src_w, 1), np.maximum(src_h, 1)
    ratio_w, ratio_h = t.width / src_w, t.height / src_h
    scale = np.maximum(ratio_w, ratio_h) if t.resize == "shorter" else np.minimum(ratio_w, ratio_h)
    new_w = np.maximum(1, np.rint(src_w * scale))
    new_h = np.maximum(1, np.rint(src_h * scale))
    return src_w, src_h, new_w, new_h


def _image_changes(t: ImageTransform, native: bool, columns: Sequence[str], values: np.ndarray,
                   max_boxes: int | None) -> dict[str, Any]:
    cols = _columns(columns, values, ("width", "height", "orientation", "flags", "reduce"))
    if cols is None:
        return {}
    width, height, orientation, flags, reduce = cols
    out: dict[str, Any] = {}
    if not native:
        src_w, src_h, new_w, new_h = _image_geometry(t, width, height, orientation)
        factor = np.maximum(new_w / src_w, new_h / src_h)
        kept = np.minimum(1.0, t.width / new_w) * np.minimum(1.0, t.height / new_h)
        out["upscaled"] = _count(factor > UPSCALE_LIMIT, factor, "max_factor")
        out["cropped"] = _count(kept < KEPT_LIMIT, kept, "min_kept", largest=False)
    out["composited"] = _count((flags & COMPOSITED) != 0)
    out["depth_scaled"] = _count((flags & DEPTH_SCALED) != 0)
    out["rotated"] = _count(orientation != 1)
    out["reduced"] = _count(reduce > 1, reduce.astype(np.float64), "max_scale")
    boxes = _columns(columns, values, ("boxes",))
    if boxes is not None and max_boxes is not None:
        out["capped"] = _count(boxes[0] > max_boxes, boxes[0].astype(np.float64), "max_boxes")
    return out


def _image_lines(t: ImageTransform, native: bool, v: Mapping[str, int], max_boxes: int | None) -> list[str]:
    w, h, o = v.get("width", 0), v.get("height", 0), v.get("orientation", 1)
    lines = [f"stored {w}x{h} pixels"]
    if o != 1:
        uw, uh = (h, w) if o >= 5 else (w, h)
        lines.append(f"EXIF orientation {o} applied: upright {uw}x{uh}")
    if v.get("flags", 0) & COMPOSITED:
        lines.append("transparency composited onto white (255, 255, 255)")
    if v.get("flags", 0) & DEPTH_SCALED:
        lines.append("16-bit or floating-point samples scaled to 8 bits")
    if v.get("reduce", 1) > 1:
        lines.append(f"decoded at 1/{v['reduce']} scale in the JPEG DCT domain (decode fast)")
    if native:
        lines.append(f"kept at its native {w}x{h}, no resizing")
    elif w > 0 and h > 0:
        geo = t.geometry(*((h, w) if o >= 5 else (w, h)))
        new_w, new_h = round(geo.sx * geo.src_w), round(geo.sy * geo.src_h)
        factor = max(geo.sx, geo.sy)
        verb = "upscaled" if factor > 1 else "downscaled"
        note = f" (more than {UPSCALE_LIMIT:g}x)" if factor > UPSCALE_LIMIT else ""
        lines.append(f"{verb} x{factor:.3f}{note} to {new_w}x{new_h} ({t.interpolation}, resize {t.resize})")
        kept = min(1.0, t.width / new_w) * min(1.0, t.height / new_h)
        if geo.off_x > 0 or geo.off_y > 0:
            cut = [f"{a} px {side}" for a, side in (
                (max(geo.off_x, 0), "left"), (max(new_w - t.width - max(geo.off_x, 0), 0), "right"),
                (max(geo.off_y, 0), "top"), (max(new_h - t.height - max(geo.off_y, 0), 0), "bottom")) if a > 0]
            lines.append(f"centre-cropped to {t.width}x{t.height}, cutting {', '.join(cut)}; "
                         f"kept {kept:.0%} of the picture")
        if new_w < t.width or new_h < t.height:
            where = "right and bottom" if t.crop == "pad" else "around it"
            lines.append(f"padded to {t.width}x{t.height} with value 0 ({where})")
    if "boxes" in v and max_boxes is not None:
        n = v["boxes"]
        lines.append(f"{n} boxes visible in the frame" + (f"; kept the first {max_boxes}" if n > max_boxes else ""))
    return lines


# ---------------------------------------------------------------------- audio
def _resampled_length(frames: np.ndarray, rates: np.ndarray, rate_out: int) -> np.ndarray:
    """Samples ``resample_poly`` gives for each record's file (``ceil(frames * up / down)``)."""
    out = np.empty_like(frames)
    for rate in np.unique(rates):
        g = math.gcd(int(rate), rate_out) if rate > 0 else rate_out
        up, down = rate_out // g, max(1, int(rate) // g)
        sel = rates == rate
        out[sel] = -(-frames[sel] * up // down)
    return out


def _audio_changes(transform: Mapping[str, Any], columns: Sequence[str], values: np.ndarray) -> dict[str, Any]:
    cols = _columns(columns, values, ("part", "rate", "channels", "frames"))
    if cols is None:
        return {}
    part, rate, channels, frames = cols
    rate_out, t = int(transform["sample_rate"]), int(transform["num_samples"])
    n_out = _resampled_length(frames, rate, rate_out)
    if transform.get("window"):
        padded = np.maximum(0, (part + 1) * t - n_out)
        trimmed = np.zeros_like(padded)
    else:
        padded, trimmed = np.maximum(0, t - n_out), np.maximum(0, n_out - t)
    resampled = rate != rate_out
    out_channels = int(transform.get("channels", 1))
    changed = channels != out_channels
    return {
        "trimmed": _count(trimmed > 0, trimmed / rate_out, "max_seconds"),
        "padded": _count(padded > 0, padded / rate_out, "max_seconds"),
        "resampled": {"count": int(resampled.sum()),
                      "from_hz": {str(int(r)): int((rate[resampled] == r).sum()) for r in np.unique(rate[resampled])}},
        "channels": {"count": int(changed.sum()),
                     "from": {str(int(c)): int((channels[changed] == c).sum()) for c in np.unique(channels[changed])}},
    }


def _audio_lines(transform: Mapping[str, Any], v: Mapping[str, int]) -> list[str]:
    rate, channels, frames, part = v.get("rate", 0), v.get("channels", 0), v.get("frames", 0), v.get("part", 0)
    rate_out, t = int(transform["sample_rate"]), int(transform["num_samples"])
    lines = [f"{rate} Hz, {channels} channel(s), {frames} frames ({frames / rate if rate else 0:.3f} s)"]
    out_channels = int(transform.get("channels", 1))
    if channels != out_channels:
        lines.append("mixed to mono (channel mean)" if out_channels == 1 else f"duplicated to {out_channels} channels")
    if rate and rate != rate_out:
        lines.append(f"resampled from {rate} Hz to {rate_out} Hz (polyphase, scipy.signal.resample_poly)")
    n_out = int(_resampled_length(np.array([frames]), np.array([rate]), rate_out)[0]) if rate else 0
    if transform.get("window"):
        lines.append(f"window {part}: seconds {part * t / rate_out:.3f} to {(part + 1) * t / rate_out:.3f} of the clip")
        padded, trimmed = max(0, (part + 1) * t - n_out), 0
    else:
        padded, trimmed = max(0, t - n_out), max(0, n_out - t)
    if trimmed:
        lines.append(f"trimmed {trimmed / rate_out:.3f} s at the end (kept the first {t / rate_out:.3f} s)")
    if padded:
        lines.append(f"zero-padded {padded / rate_out:.3f} s at the end")
    return lines


# ---------------------------------------------------------------------- dispatch
def _image_transform(transform: Mapping[str, Any]) -> tuple[ImageTransform, bool, int | None] | None:
    try:
        t = ImageTransform.from_json(transform)
    except ConfigError:
        return None
    max_boxes = transform.get("max_boxes")
    return t, bool(transform.get("native", False)), max_boxes if isinstance(max_boxes, int) else None


def _is_audio(transform: Mapping[str, Any]) -> bool:
    return isinstance(transform.get("sample_rate"), int) and isinstance(transform.get("num_samples"), int)


def summarize(payload: str, transform: Mapping[str, Any], columns: Sequence[str], values: np.ndarray) -> dict[str, Any]:
    """Counts of what conversion changed over every record (``values``: the provenance field ``[N, C]``):
    clips trimmed or padded, rates resampled from, images upscaled more than 2x, ... Stored at the commit
    as ``provenance.changes``; ``{}`` for a payload or transform this module does not know."""
    values = np.asarray(values).reshape(-1, len(columns))
    out: dict[str, Any]
    if payload == "image" and (image := _image_transform(transform)) is not None:
        out = _image_changes(*image[:2], columns, values, image[2])
    elif payload == "audio" and _is_audio(transform):
        out = _audio_changes(transform, columns, values)
    else:
        return {}
    return {"records": int(values.shape[0]), **out}


def describe(payload: str, transform: Mapping[str, Any], values: Mapping[str, int]) -> list[str]:
    """What conversion did to one record, one line per step (from its provenance ``values``)."""
    if payload == "image" and (image := _image_transform(transform)) is not None:
        return _image_lines(image[0], image[1], values, image[2])
    if payload == "audio" and _is_audio(transform):
        return _audio_lines(transform, values)
    measured = ", ".join(f"{k} {v}" for k, v in values.items() if k not in ("input", "part"))
    return [measured] if measured else []  # a kind without columns of its own (write) changed nothing it knows


def _rates(c: Mapping[str, Any], key: str, field: str, unit: str) -> str:
    found = c[key].get(field, {})
    return ", ".join(f"{k}{unit}: {v}" for k, v in sorted(found.items(), key=lambda kv: int(kv[0])))


#: How each count of :func:`summarize` reads, in the order printed: ``(key, text after the count)``.
_SENTENCES: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("upscaled", lambda c: f"upscaled by more than {UPSCALE_LIMIT:g}x (at most {c['upscaled']['max_factor']:.2f}x)"),
    ("cropped", lambda c: f"cropped to less than {KEPT_LIMIT:.0%} of the picture "
                          f"(as little as {c['cropped']['min_kept']:.0%} kept)"),
    ("composited", lambda c: "with transparency composited onto white"),
    ("depth_scaled", lambda c: "with 16-bit or float samples scaled to 8 bits"),
    ("rotated", lambda c: "rotated or flipped upright by their EXIF orientation"),
    ("reduced", lambda c: "decoded at a reduced JPEG scale (decode fast)"),
    ("capped", lambda c: f"with more boxes than kept (at most {c['capped']['max_boxes']:.0f} visible)"),
    ("trimmed", lambda c: f"trimmed (at most {c['trimmed']['max_seconds']:.3f} s cut)"),
    ("padded", lambda c: f"zero-padded (at most {c['padded']['max_seconds']:.3f} s added)"),
    ("resampled", lambda c: f"resampled (from {_rates(c, 'resampled', 'from_hz', ' Hz')})"),
    ("channels", lambda c: f"with their channels mixed or duplicated (from {_rates(c, 'channels', 'from', ' channels')})"),
)


def change_lines(changes: Mapping[str, Any]) -> list[str]:
    """The ``changes`` counts as short sentences (nothing for what did not happen)."""
    lines = []
    for key, sentence in _SENTENCES:
        entry = changes.get(key)
        count = int(entry.get("count", 0)) if isinstance(entry, Mapping) else 0
        if count:
            lines.append(f"{count} {sentence(changes)}")
    return lines
