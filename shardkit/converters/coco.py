"""COCO detection corpora: ``annotations/instances_<split>.json`` plus the image folder.

:class:`CocoConverter` scans the annotation file (untrusted JSON, bounded and checked entry by entry)
into one :class:`CocoItem` per image; :class:`CocoDecoder` decodes an image and maps its boxes through
the transform's exact geometry into fixed-size ``boxes`` / ``box_labels`` fields (docs/design.md §5).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from shardkit.converters import untrusted_json
from shardkit.converters.base import PROVENANCE, Converter, Decoded, Decoder, Note, Record, ScanResult, Skip
from shardkit.converters.boxes import map_boxes, orient_boxes, xywh_to_xyxy
from shardkit.converters.images import IMAGE_COLUMNS, IMAGE_OPTIONS, ImageTransform
from shardkit.converters.options import Option, count, path_text, text
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import FieldSpec

__all__ = ["CocoConverter", "CocoDecoder", "CocoItem", "resolve_inside"]

_INT64 = (-(2**63), 2**63 - 1)
_OPTIONS = (
    Option("split", str, None, "Annotation file annotations/instances_<split>.json (default the only one, or train).",
           parse=text, metavar="NAME"),
    Option("image_dir", str, None, "Image folder (default <split>/ or images/<split>/ next to annotations/).",
           parse=path_text, metavar="DIR"),
    Option("max_boxes", int, 100, "Boxes kept per image; images with more are noted as capped.",
           parse=count(1, 1 << 20), metavar="N"),
    *IMAGE_OPTIONS,
)


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


def _is_id(v: Any) -> bool:
    """An integer that fits the int64 fields it is stored in."""
    return _is_int(v) and _INT64[0] <= v <= _INT64[1]


def _is_num(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond float range
        return False


def _is_size(v: Any) -> bool:
    return _is_int(v) and 0 < v < 2**31


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class CocoItem:
    """One image of the input sequence: its id, file and annotations (boxes ``[x, y, w, h]``)."""

    image_id: int
    file_name: str
    size: tuple[int, int] | None
    boxes: np.ndarray
    categories: np.ndarray
    crowd: np.ndarray


class CocoDecoder(Decoder):
    """Decode one :class:`CocoItem`: the image through the transform, its boxes into the frame."""

    def __init__(self, image_dir: Path, image: ImageTransform, max_boxes: int, ann_name: str) -> None:
        super().__init__("image", FieldSpec((image.height, image.width, 3), "uint8"))
        self.image_dir = image_dir
        self.image = image
        self.max_boxes = max_boxes
        self.ann_name = ann_name

    def item_path(self, item: CocoItem) -> str:
        return str(self.image_dir / item.file_name)

    def decode(self, item: CocoItem, start: int = 0) -> Decoded:
        path = resolve_inside(self.image_dir, item.file_name)
        loaded = self.image.load(path)
        geo, stored = loaded.geometry, loaded.stored_size
        boxes = xywh_to_xyxy(item.boxes)
        if item.size is None or tuple(item.size) == tuple(stored):
            boxes = orient_boxes(boxes, loaded.orientation, *stored)
        elif tuple(item.size) != (geo.src_w, geo.src_h):
            raise InputFileError(
                str(path),
                f"size-mismatch: image is {stored[0]}x{stored[1]} but {self.ann_name} says {item.size[0]}x{item.size[1]}",
            )
        mapped, keep = map_boxes(boxes, geo)
        idx = np.flatnonzero(keep)
        m = self.max_boxes
        notes: tuple[Note, ...] = ()
        if idx.size > m:
            notes = (Note("capped", f"{idx.size} visible boxes, kept the first {m}"),)
            idx = idx[:m]
        n = idx.size
        out_boxes = np.zeros((m, 4), np.float32)
        out_labels = np.full((m,), -1, np.int32)
        out_crowd = np.zeros((m,), np.uint8)
        out_boxes[:n] = mapped[idx]
        out_labels[:n] = item.categories[idx]
        out_crowd[:n] = item.crowd[idx]
        if n:
            sel = mapped[idx]
            area = (sel[:, 2] - sel[:, 0]) * (sel[:, 3] - sel[:, 1])
            label = int(item.categories[idx][int(np.argmax(area))])
        else:
            label = -1
        record: Record = {
            "image": loaded.array,
            "label": np.int64(label),
            "image_id": np.int64(item.image_id),
            "boxes": out_boxes,
            "box_labels": out_labels,
            "num_boxes": np.int32(n),
            "iscrowd": out_crowd,
            "orig_size": np.array([geo.src_h, geo.src_w], np.int32),
            PROVENANCE: {**loaded.provenance(), "boxes": int(np.flatnonzero(keep).size)},
        }
        return Decoded([record], notes=notes)


class CocoConverter(Converter):
    """Convert a COCO ``instances_*.json`` detection corpus.

    The image folder is ``<split>/``, ``images/<split>/`` or the ``image_dir`` option; ``SRC`` may
    also be the annotation file itself. Record fields (``M = max_boxes``, default 100):

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

    JSON that does not parse, or without an ``images`` list, stops the run. A bad entry (``malformed``:
    wrong type, id beyond int64, nested too deeply; a duplicate image id, an unknown image or category)
    is skipped with a reason naming it; a ``file_name`` outside the image folder as ``outside-corpus``.
    """

    name = "coco"
    payload = "image"
    options = _OPTIONS
    chunk_size = 4
    detect_priority = 10
    progress_unit = "img"
    one_record_per_input = True
    #: The image columns, and how many boxes were visible in the frame (more than ``max_boxes``: capped).
    provenance_columns = (*IMAGE_COLUMNS, "boxes")

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.image = ImageTransform.from_options(self.values, self.label)
        self.max_boxes = int(self.values["max_boxes"])
        if self.src.is_file():
            self.ann_file = self.src
            self.root = self.src.parent.parent if self.src.parent.name == "annotations" else self.src.parent
            self.split = self.src.stem.removeprefix("instances_")
        else:
            self.root = self.src
            self.split, self.ann_file = self._choose_annotations()
        self.values["split"] = self.split
        cands = [self.root / self.split, self.root / "images" / self.split]
        if self.values.get("image_dir"):
            cands = [Path(self.values["image_dir"])]
        self.image_dir = next((c for c in cands if c.is_dir()), cands[0]).resolve()
        if not self.image_dir.is_dir():
            raise ConversionError(
                f"{self.ann_file}: image folder not found (looked for {', '.join(str(c) for c in cands)}); "
                f"pass {self.label('image_dir')}"
            )
        self.values["image_dir"] = str(self.image_dir)
        self.categories: list[dict[str, Any]] = []
        self._doc_skips: list[Skip] = []
        self._items: list[CocoItem] = []
        self._load()

    def _choose_annotations(self) -> tuple[str, Path]:
        found = {p.stem.removeprefix("instances_"): p for p in sorted((self.src / "annotations").glob("instances_*.json"))}
        requested = self.values.get("split")
        if requested is not None:
            if requested not in found:
                raise ConfigError(
                    f"{self.src}/annotations: no instances_{requested}.json; available splits: "
                    f"{', '.join(found) or 'none'}"
                )
            return requested, found[requested]
        if len(found) == 1:
            return next(iter(found.items()))
        if "train" in found:
            return "train", found["train"]
        if not found:
            raise ConversionError(f"{self.src}: no annotations/instances_*.json found")
        raise ConfigError(f"{self.src}: several annotation files ({', '.join(found)}); choose one with {self.label('split')}")

    @classmethod
    def detect(cls, src: Path) -> bool:
        if src.is_file():
            return src.suffix == ".json" and src.name.startswith("instances_")
        return any((src / "annotations").glob("instances_*.json"))

    # ------------------------------------------------------------------ annotation file
    def _read_document(self) -> tuple[list[Any], list[Any], list[Any], bool]:
        """``(images, annotations, categories, truncated)`` of the annotation file."""
        ann = self.ann_file
        try:
            raw = ann.read_bytes()
            self._ann_crc = zlib.crc32(raw)
            doc, truncated = untrusted_json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConversionError(f"{ann}: malformed JSON: {exc}") from None
        except RecursionError:
            raise ConversionError(f"{ann}: malformed JSON: brackets nested without end") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{ann}: cannot read the annotation file: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            found = type(doc.get("images")).__name__ if isinstance(doc, dict) else type(doc).__name__
            raise ConversionError(f"{ann}: expected a COCO object with an 'images' list, found {found}")
        anns = doc.get("annotations", [])
        cats = doc.get("categories", [])
        if not isinstance(anns, list) or not isinstance(cats, list):
            raise ConversionError(
                f"{ann}: expected 'annotations' and 'categories' to be lists, found "
                f"{type(anns).__name__} and {type(cats).__name__}"
            )
        return doc["images"], anns, cats, truncated

    def _entries(self, values: list[Any], what: str, truncated: bool) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(position, entry)`` of the dict entries of ``values``; the others become skips, in order."""
        for i, v in enumerate(values):
            where = f"{self.ann_file}#{what}[{i}]"
            if not isinstance(v, dict):
                self._doc_skips.append(Skip(where, f"malformed: expected an object, found {type(v).__name__}"))
            elif truncated and untrusted_json.holds_too_deep(v):
                self._doc_skips.append(Skip(where, f"malformed: holds a value nested more than {untrusted_json.MAX_DEPTH} levels deep"))
            else:
                yield i, v

    def _load_categories(self, cats: list[Any], truncated: bool) -> dict[Any, int]:
        """Fill :attr:`categories`; returns original id -> contiguous id."""
        ann = self.ann_file
        cat_by_id: dict[int, dict[str, Any]] = {}
        for i, c in self._entries(cats, "categories", truncated):
            where = f"{ann}#categories[{i}]"
            sup = c.get("supercategory")
            if not _is_id(c.get("id")) or not isinstance(c.get("name"), str) or not isinstance(sup, (str, type(None))):
                self._doc_skips.append(Skip(where, "malformed: category needs an integer id (int64), a name and a "
                                                   f"text supercategory, found id {_short(c.get('id'))}, name "
                                                   f"{_short(c.get('name'))}, supercategory {_short(sup)}"))
            elif c["id"] in cat_by_id:
                self._doc_skips.append(Skip(where, f"duplicate-id: category id {c['id']} appears twice"))
            else:
                cat_by_id[c["id"]] = c
        ids = sorted(cat_by_id)
        self.categories = [
            {"id": cid, "name": cat_by_id[cid]["name"], "supercategory": cat_by_id[cid].get("supercategory")}
            for cid in ids
        ]
        return {cid: k for k, cid in enumerate(ids)}

    def _load_images(self, images: list[Any], truncated: bool) -> tuple[dict[int, dict[str, Any]], set[int]]:
        """Usable image entries by id, and the ids claimed more than once."""
        ann = self.ann_file
        entries: list[dict[str, Any]] = []
        for i, im in self._entries(images, "images", truncated):
            where = f"{ann}#images[{i}]"
            if not _is_id(im.get("id")) or not isinstance(im.get("file_name"), str) or not im["file_name"]:
                self._doc_skips.append(Skip(where, "malformed: image entry needs an integer id (int64) and a "
                                                   f"file_name, found id {_short(im.get('id'))}, file_name "
                                                   f"{_short(im.get('file_name'))}"))
            elif any(k in im and not _is_size(im[k]) for k in ("width", "height")):
                self._doc_skips.append(Skip(where, "malformed: width and height must be positive integers, found "
                                                   f"{_short(im.get('width'))} x {_short(im.get('height'))}"))
            else:
                entries.append(im)
        counts = Counter(im["id"] for im in entries)
        by_id: dict[int, dict[str, Any]] = {}
        for im in entries:
            if counts[im["id"]] > 1:
                self._doc_skips.append(Skip(
                    str(self.image_dir / im["file_name"]),
                    f"duplicate-id: image id {im['id']} appears {counts[im['id']]} times in {ann.name}",
                ))
            else:
                by_id[im["id"]] = im
        return by_id, {k for k, n in counts.items() if n > 1}

    def _annotation_problem(self, a: dict[str, Any], images: dict[int, Any], contiguous: dict[Any, int]) -> str | None:
        """Why annotation ``a`` cannot be used, or ``None``."""
        if not _is_id(a.get("image_id")):
            return f"malformed: annotation needs an integer image_id (int64), found {_short(a.get('image_id'))}"
        if a["image_id"] not in images:
            return f"unknown-image: annotation for image id {a['image_id']}, not in 'images'"
        if not _is_id(a.get("category_id")):
            return f"malformed: annotation needs an integer category_id (int64), found {_short(a.get('category_id'))}"
        if a["category_id"] not in contiguous:
            return f"unknown-category: category id {a['category_id']} is not in 'categories'"
        bbox = a.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_num(v) for v in bbox) and bbox[2] >= 0 and bbox[3] >= 0):
            return f"malformed: bbox must be [x, y, w, h] with w, h >= 0, found {_short(bbox)}"
        if a.get("iscrowd", 0) not in (0, 1) or isinstance(a.get("iscrowd"), float):
            return f"malformed: iscrowd must be 0 or 1, found {_short(a.get('iscrowd'))}"
        return None

    def _load(self) -> None:
        images_doc, anns, cats, truncated = self._read_document()
        contiguous = self._load_categories(cats, truncated)
        images, dup_ids = self._load_images(images_doc, truncated)
        per_image: dict[int, list[tuple[list[float], int, int]]] = {k: [] for k in images}
        for i, a in self._entries(anns, "annotations", truncated):
            if _is_id(a.get("image_id")) and a["image_id"] in dup_ids:
                continue  # the image itself is skipped as duplicate-id
            problem = self._annotation_problem(a, images, contiguous)
            if problem is not None:
                where = f"{self.ann_file}#annotations[{i}]" + (f" id={_short(a['id'])}" if "id" in a else "")
                self._doc_skips.append(Skip(where, problem))
                continue
            per_image[a["image_id"]].append(
                ([float(v) for v in a["bbox"]], contiguous[a["category_id"]], int(a.get("iscrowd", 0)))
            )
        for image_id in sorted(images):
            im, rows = images[image_id], per_image[image_id]
            size = (im["width"], im["height"]) if "width" in im and "height" in im else None
            self._items.append(CocoItem(
                image_id,
                im["file_name"],
                size,
                np.array([r[0] for r in rows], dtype=np.float64).reshape(-1, 4),
                np.array([r[1] for r in rows], dtype=np.int32),
                np.array([r[2] for r in rows], dtype=np.uint8),
            ))

    # ------------------------------------------------------------------ converter interface
    def source_root(self) -> Path:
        return self.root

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

    def make_decoder(self) -> CocoDecoder:
        return CocoDecoder(self.image_dir, self.image, self.max_boxes, self.ann_file.name)

    def transform(self) -> dict[str, Any]:
        return {**self.image.to_json(), "max_boxes": self.max_boxes}

    def source(self) -> dict[str, Any]:
        return {**super().source(), "annotations": str(self.ann_file), "images": str(self.image_dir)}

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
            "annotations": str(self.ann_file),
            "transform": self.transform(),
            "categories": self.categories,
        }

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        return f"{super().inputs_fingerprint(scan)}:{self._ann_crc:08x}"
