"""Class-folder image corpora (ImageNet style): ``ROOT/[train|val|test/]<class>/<image>``.

Record: ``image`` uint8 ``[H, W, 3]`` and ``label`` int64 (index into the sorted class names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import Converter, Record, ScanResult, register
from shardkit.converters.classfolders import (
    ClassFolderFields,
    choose_split,
    class_names,
    find_splits,
    scan_class_files,
)
from shardkit.converters.images import IMAGE_EXTENSIONS, ImageTransform
from shardkit.errors import ConversionError
from shardkit.formats import FieldSpec

__all__ = ["ImageFolderConverter", "IMAGE_OPTIONS"]

#: Options of every image kind.
IMAGE_OPTIONS: dict[str, Any] = {
    "size": None,
    "resize": None,
    "crop": "center",
    "interpolation": "bilinear",
    "max_pixels": None,
}


@register
class ImageFolderConverter(ClassFolderFields, Converter):
    """Convert class folders of images; label = folder name, label names sorted."""

    name = "imagefolder"
    payload = "image"
    media_extensions = frozenset(IMAGE_EXTENSIONS)
    media_name = "image"
    option_defaults = {"split": None, **IMAGE_OPTIONS}
    chunk_size = 4

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.image = ImageTransform.from_options(self.options)
        splits = find_splits(self.src)
        self.split = choose_split(splits, self.options.get("split"), self.src)
        self.options["split"] = self.split
        self.base = self.src / self.split if self.split else self.src
        self.classes = class_names(self.src, splits)
        if not self.classes:
            raise ConversionError(f"{self.base}: no class folders found (expected {self.base}/<class>/<image files>)")

    def scan(self) -> ScanResult:
        items = scan_class_files(self.base, self.classes, IMAGE_EXTENSIONS)
        if not items:
            raise ConversionError(f"{self.base}: the class folders hold no files")
        return ScanResult(items=items)

    @property
    def media_transform(self) -> Any:
        return self.image

    def record_spec(self) -> FieldSpec:
        return FieldSpec((self.image.height, self.image.width, 3), "uint8")

    def decode(self, item: tuple[str, int]) -> list[Record]:
        rel, label = item
        path = self.checked_path(rel)
        arr, _, _, _ = self.image.load(path)
        return [{"image": arr, "label": np.int64(label)}]
