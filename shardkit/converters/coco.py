"""COCO detection corpora: ``annotations/instances_<split>.json`` plus the image folder.

The image folder is ``<split>/``, ``images/<split>/`` or the ``image_dir`` option. ``SRC`` may also be
the annotation file itself.

Record fields (``M = max_boxes``, default 100):

* ``image`` uint8 ``[H, W, 3]``; ``image_id`` int64; ``orig_size`` int32 ``[2]`` = upright
  (height, width) of the source image.
* ``boxes`` float32 ``[M, 4]``: ``x0, y0, x1, y1`` in output pixels (EXIF orientation, scale and
  crop/pad applied, clipped to the frame); boxes with no area left are dropped; rows past
  ``num_boxes`` are zero.
* ``box_labels`` int32 ``[M]``: contiguous category ids (index into the sorted original ids);
  rows past ``num_boxes`` are -1 (0 is a real class). ``iscrowd`` uint8 ``[M]``; ``num_boxes`` int32.
* ``label`` int64: the ``box_label`` of the largest box in the output frame (first one on ties),
  or -1 for an image without boxes, so every kind has a ``label``.

Category names and original ids are kept in the metadata (``labels["label"]`` and
``extra["categories"]``). Images with more than ``max_boxes`` visible boxes keep the first
``max_boxes`` (annotation order) and are counted in the summary as ``capped``.

Problems with the annotation file itself: JSON that does not parse, or a top level without an
``images`` list, stops the run (there is nothing to skip to: an empty dataset would look complete).
Malformed entries, duplicate image ids (every entry claiming the id is skipped: its annotations
cannot be attributed), annotations for unknown images or categories are skipped with a reason.
``file_name`` entries that are absolute, contain ``..`` or resolve (through symlinks) outside the
image folder are skipped as ``outside-corpus`` without opening them.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections import Counter
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from shardkit.converters.base import Converter, Record, ScanResult, Skip, register
from shardkit.converters.boxes import map_boxes, orient_boxes, xywh_to_xyxy
from shardkit.converters.imagefolder import IMAGE_OPTIONS
from shardkit.converters.images import ImageTransform
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import FieldSpec

__all__ = ["CocoConverter", "resolve_inside"]


def resolve_inside(root: Path, file_name: str) -> Path:
    """``root / file_name``, or ``InputFileError('outside-corpus: ...')`` if it could escape ``root``."""
    shown = str(root / file_name) if isinstance(file_name, str) else repr(file_name)
    if not isinstance(file_name, str) or not file_name or "\x00" in file_name:
        raise InputFileError(shown, "malformed: file_name must be a non-empty string")
    posix, win = PurePosixPath(file_name), PureWindowsPath(file_name)
    if posix.is_absolute() or win.is_absolute() or win.drive or file_name.startswith(("/", "\\")):
        raise InputFileError(file_name, "outside-corpus: file_name is an absolute path")
    if ".." in posix.parts or ".." in win.parts:
        raise InputFileError(shown, "outside-corpus: file_name contains '..'")
    path = root / file_name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise InputFileError(shown, f"outside-corpus: resolves (through a symlink) to {real}, outside {real_root}")
    return path


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@register
class CocoConverter(Converter):
    """Convert a COCO ``instances_*.json`` detection corpus."""

    name = "coco"
    payload = "image"
    option_defaults = {"split": None, "image_dir": None, "max_boxes": 100, **IMAGE_OPTIONS}
    chunk_size = 4
    detect_priority = 10

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.image = ImageTransform.from_options(self.options)
        self.max_boxes = int(self.options["max_boxes"])
        if self.max_boxes < 1:
            raise ConfigError(f"--max-boxes: expected 1 or more, found {self.max_boxes}")
        if self.src.is_file():
            self.ann_file = self.src
            self.root = self.src.parent.parent if self.src.parent.name == "annotations" else self.src.parent
            self.split = self.src.stem.removeprefix("instances_")
        else:
            self.root = self.src
            found = {p.stem.removeprefix("instances_"): p for p in sorted((self.src / "annotations").glob("instances_*.json"))}
            requested = self.options.get("split")
            if requested is not None:
                if requested not in found:
                    raise ConfigError(
                        f"{self.src}/annotations: no instances_{requested}.json; available splits: "
                        f"{', '.join(found) or 'none'}"
                    )
                self.split = requested
            elif len(found) == 1:
                self.split = next(iter(found))
            elif "train" in found:
                self.split = "train"
            elif not found:
                raise ConversionError(f"{self.src}: no annotations/instances_*.json found")
            else:
                raise ConfigError(f"{self.src}: several annotation files ({', '.join(found)}); choose one with --split")
            self.ann_file = found[self.split]
        self.options["split"] = self.split
        cands = [self.root / self.split, self.root / "images" / self.split]
        if self.options.get("image_dir"):
            self.image_dir = Path(self.options["image_dir"])
            cands = [self.image_dir]
        else:
            self.image_dir = next((c for c in cands if c.is_dir()), cands[0])
        if not self.image_dir.is_dir():
            raise ConversionError(
                f"{self.ann_file}: image folder not found (looked for {', '.join(str(c) for c in cands)}); "
                "pass image_dir"
            )
        self.options["image_dir"] = str(self.image_dir.resolve())
        self.categories: list[dict[str, Any]] = []
        self._doc_skips: list[Skip] = []
        self._items: list[Any] = []
        self._load()

    @classmethod
    def detect(cls, src: Path) -> bool:
        if src.is_file():
            return src.suffix == ".json" and src.name.startswith("instances_")
        return any((src / "annotations").glob("instances_*.json"))

    # ------------------------------------------------------------------ annotation file
    def _load(self) -> None:
        ann = self.ann_file
        try:
            raw = ann.read_bytes()
            self._ann_crc = zlib.crc32(raw)
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConversionError(f"{ann}: malformed JSON: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{ann}: cannot read the annotation file: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            raise ConversionError(f"{ann}: expected a COCO object with an 'images' list, found {type(doc).__name__}")
        anns = doc.get("annotations", [])
        cats = doc.get("categories", [])
        if not isinstance(anns, list) or not isinstance(cats, list):
            raise ConversionError(f"{ann}: expected 'annotations' and 'categories' to be lists")
        skips = self._doc_skips

        cat_by_id: dict[int, dict[str, Any]] = {}
        for i, c in enumerate(cats):
            if not isinstance(c, dict) or not _is_int(c.get("id")) or not isinstance(c.get("name"), str):
                skips.append(Skip(f"{ann}#categories[{i}]", "malformed: category needs an integer id and a name"))
            elif c["id"] in cat_by_id:
                skips.append(Skip(f"{ann}#categories[{i}]", f"duplicate-id: category id {c['id']} appears twice"))
            else:
                cat_by_id[c["id"]] = c
        ids = sorted(cat_by_id)
        contiguous = {cid: k for k, cid in enumerate(ids)}
        self.categories = [
            {"id": cid, "name": cat_by_id[cid]["name"], "supercategory": cat_by_id[cid].get("supercategory")}
            for cid in ids
        ]

        entries: list[dict[str, Any]] = []
        for i, im in enumerate(doc["images"]):
            if (
                not isinstance(im, dict)
                or not _is_int(im.get("id"))
                or not isinstance(im.get("file_name"), str)
                or not im["file_name"]
            ):
                skips.append(Skip(f"{ann}#images[{i}]", "malformed: image entry needs an integer id and a file_name"))
                continue
            entries.append(im)
        counts = Counter(im["id"] for im in entries)
        images: dict[int, dict[str, Any]] = {}
        for im in entries:
            if counts[im["id"]] > 1:
                skips.append(Skip(
                    str(self.image_dir / im["file_name"]),
                    f"duplicate-id: image id {im['id']} appears {counts[im['id']]} times in {ann.name}",
                ))
            else:
                images[im["id"]] = im
        dup_ids = {k for k, n in counts.items() if n > 1}

        per_image: dict[int, list[tuple[list[float], int, int]]] = {k: [] for k in images}
        for i, a in enumerate(anns):
            where = f"{ann}#annotations[{i}]" + (f" id={a.get('id')}" if isinstance(a, dict) and "id" in a else "")
            if not isinstance(a, dict) or not _is_int(a.get("image_id")):
                skips.append(Skip(where, "malformed: annotation needs an integer image_id"))
                continue
            if a["image_id"] in dup_ids:
                continue  # the image itself is skipped as duplicate-id
            if a["image_id"] not in images:
                skips.append(Skip(where, f"unknown-image: annotation for image id {a['image_id']}, not in 'images'"))
                continue
            if a.get("category_id") not in contiguous:
                skips.append(Skip(where, f"unknown-category: category id {a.get('category_id')!r} is not in 'categories'"))
                continue
            bbox = a.get("bbox")
            if (
                not isinstance(bbox, list)
                or len(bbox) != 4
                or not all(_is_num(v) for v in bbox)
                or bbox[2] < 0
                or bbox[3] < 0
            ):
                skips.append(Skip(where, f"malformed: bbox must be [x, y, w, h] with w, h >= 0, found {bbox!r}"))
                continue
            crowd = a.get("iscrowd", 0)
            per_image[a["image_id"]].append(([float(v) for v in bbox], contiguous[a["category_id"]], 1 if crowd else 0))

        for image_id in sorted(images):
            im = images[image_id]
            rows = per_image[image_id]
            size = (im.get("width"), im.get("height"))
            self._items.append((
                image_id,
                im["file_name"],
                size if all(_is_int(v) for v in size) else None,
                np.array([r[0] for r in rows], dtype=np.float64).reshape(-1, 4),
                np.array([r[1] for r in rows], dtype=np.int32),
                np.array([r[2] for r in rows], dtype=np.uint8),
            ))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_items"] = []
        return state

    # ------------------------------------------------------------------ converter interface
    def scan(self) -> ScanResult:
        return ScanResult(items=self._items, skipped=list(self._doc_skips))

    def record_spec(self) -> FieldSpec:
        return FieldSpec((self.image.height, self.image.width, 3), "uint8")

    def fields(self) -> dict[str, FieldSpec]:
        m = self.max_boxes
        return {
            "label": FieldSpec((), "int64"),
            "image_id": FieldSpec((), "int64"),
            "boxes": FieldSpec((m, 4), "float32"),
            "box_labels": FieldSpec((m,), "int32"),
            "num_boxes": FieldSpec((), "int32"),
            "iscrowd": FieldSpec((m,), "uint8"),
            "orig_size": FieldSpec((2,), "int32"),
        }

    def labels(self) -> dict[str, list[str]]:
        names = [c["name"] for c in self.categories]
        return {"label": names, "box_labels": names}

    def transform(self) -> dict[str, Any]:
        return {**self.image.to_json(), "max_boxes": self.max_boxes}

    def source(self) -> dict[str, Any]:
        return {**super().source(), "annotations": str(self.ann_file.resolve()), "images": str(self.image_dir.resolve())}

    def extra(self) -> dict[str, Any]:
        return {
            "categories": self.categories,
            "category_ids": [c["id"] for c in self.categories],
            "box_labels_padding": -1,
            "label_rule": "box_label of the largest box in the output frame; -1 for an image without boxes",
        }

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "annotations": str(self.ann_file.resolve()),
            "transform": self.transform(),
            "categories": self.categories,
        }

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        return f"{super().inputs_fingerprint(scan)}:{self._ann_crc:08x}"

    def item_path(self, item: Any) -> str:
        return str(self.image_dir / item[1]) if isinstance(item[1], str) else repr(item[1])

    def decode(self, item: Any) -> list[Record]:
        image_id, file_name, size, xywh, cats, crowd = item
        path = resolve_inside(self.image_dir, file_name)
        arr, geo, orientation, stored = self.image.load(path)
        boxes = xywh_to_xyxy(xywh)
        upright = (geo.src_w, geo.src_h)
        if size is None or tuple(size) == tuple(stored):
            boxes = orient_boxes(boxes, orientation, *stored)
        elif tuple(size) != upright:
            raise InputFileError(
                str(path),
                f"size-mismatch: image is {stored[0]}x{stored[1]} but {self.ann_file.name} says {size[0]}x{size[1]}",
            )
        mapped, keep = map_boxes(boxes, geo)
        idx = np.flatnonzero(keep)
        m = self.max_boxes
        record: Record = {}
        if idx.size > m:
            record["_note"] = np.array(f"capped: {idx.size} visible boxes, kept the first {m}")
            idx = idx[:m]
        n = idx.size
        out_boxes = np.zeros((m, 4), np.float32)
        out_labels = np.full((m,), -1, np.int32)
        out_crowd = np.zeros((m,), np.uint8)
        out_boxes[:n] = mapped[idx]
        out_labels[:n] = cats[idx]
        out_crowd[:n] = crowd[idx]
        if n:
            sel = mapped[idx]
            area = (sel[:, 2] - sel[:, 0]) * (sel[:, 3] - sel[:, 1])
            label = int(cats[idx][int(np.argmax(area))])
        else:
            label = -1
        record.update({
            "image": arr,
            "label": np.int64(label),
            "image_id": np.int64(image_id),
            "boxes": out_boxes,
            "box_labels": out_labels,
            "num_boxes": np.int32(n),
            "iscrowd": out_crowd,
            "orig_size": np.array([geo.src_h, geo.src_w], np.int32),
        })
        return [record]
