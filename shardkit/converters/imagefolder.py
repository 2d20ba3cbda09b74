"""Class-folder image corpora (ImageNet style): ``ROOT/[train|val|test/]<class>/<image>``.

Record: ``image`` uint8 ``[H, W, 3]`` and ``label`` int64 (index into the sorted class names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.base import PROVENANCE, Decoded, ScanResult
from shardkit.converters.classfolders import ClassFolderConverter, ClassFolderDecoder
from shardkit.converters.images import IMAGE_COLUMNS, IMAGE_EXTENSIONS, IMAGE_OPTIONS, ImageTransform
from shardkit.converters.options import Option, text
from shardkit.errors import ConversionError
from shardkit.formats import FieldSpec

__all__ = ["ImageFolderConverter", "ImageFolderDecoder"]

_SPLIT = Option("split", str, None, "Split directory to convert (default train, or the only one).",
                parse=text, metavar="NAME")


class ImageFolderDecoder(ClassFolderDecoder):
    """Decode one ``(path, label)`` item with the image transform."""

    def __init__(self, base: Path, image: ImageTransform) -> None:
        super().__init__("image", FieldSpec((image.height, image.width, 3), "uint8"), base,
                         frozenset(IMAGE_EXTENSIONS), "image")
        self.image = image

    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        rel, label = item
        loaded = self.image.load(self.checked_path(rel))
        return Decoded([{"image": loaded.array, "label": np.int64(label), PROVENANCE: loaded.provenance()}])

    def input_files(self, item: tuple[str, int]) -> tuple[str, ...]:
        return (self.item_path(item),)


class ImageFolderConverter(ClassFolderConverter):
    """Convert class folders of images; label = folder name, label names sorted."""

    name = "imagefolder"
    payload = "image"
    media_extensions = frozenset(IMAGE_EXTENSIONS)
    media_name = "image"
    options = (_SPLIT, *IMAGE_OPTIONS)
    chunk_size = 4
    progress_unit = "img"
    one_record_per_input = True
    provenance_columns = IMAGE_COLUMNS

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.image = ImageTransform.from_options(self.values, self.label)

    def scan(self) -> ScanResult:
        items = self.scan_files()
        if not items:
            raise ConversionError(f"{self.base}: the class folders hold no files")
        return ScanResult(items=items)

    def media_transform(self) -> ImageTransform:
        return self.image

    def record_spec(self) -> FieldSpec:
        return FieldSpec((self.image.height, self.image.width, 3), "uint8")

    def make_decoder(self) -> ImageFolderDecoder:
        return ImageFolderDecoder(self.base, self.image)
