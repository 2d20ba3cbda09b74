"""Corpus kinds used only by the tests of conversions in parts; workers import them by module path.

* ``slowimages``: class-folder images whose decoder sleeps a little per image, so a conversion on a
  cluster lasts long enough to kill a worker in the middle of a part.
* ``vanishingimages``: class-folder images whose corpus disappears right after the scan (renamed
  aside), which is what a worker sees when the corpus is not mounted there.
* ``keyed``: "inputs" are text files holding record numbers; record ``k`` is the pattern of
  ``tests/helpers/sampler_data.encode`` with ``label = 3k`` and ``pair = (k, -k)``, so the sampler's
  proof tests can run on a dataset made by appends and merges.
* ``blockingimages``: class-folder images whose decoder, in a worker process, notes that the worker
  is converting (a file named by its pid in ``started/`` next to the corpus) and then never returns,
  so a test can kill the conversion while every worker is in the middle of a part.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shardkit.converters.base import Converter, Decoded, Decoder, ScanResult
from shardkit.converters.imagefolder import ImageFolderConverter, ImageFolderDecoder
from shardkit.converters.images import ImageTransform
from shardkit.formats import FieldSpec

__all__ = ["SlowImages", "VanishingImages", "Keyed", "DyingImages", "BlockingImages"]


class SlowDecoder(ImageFolderDecoder):
    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        time.sleep(0.15)
        return super().decode(item, start)


class SlowImages(ImageFolderConverter):
    name = "slowimages"

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False  # only with --kind: registered kinds must not make other corpora ambiguous

    def make_decoder(self) -> ImageFolderDecoder:
        return SlowDecoder(self.base, self.image)


class VanishingImages(ImageFolderConverter):
    name = "vanishingimages"

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def scan(self) -> ScanResult:
        result = super().scan()
        os.rename(self.src, self.src.with_name(self.src.name + ".moved"))
        return result


class KeyedDecoder(Decoder):
    def __init__(self, root: Path) -> None:
        super().__init__("image", FieldSpec((4, 4, 1), "uint8"))
        self.root = root

    def decode(self, item: str, start: int = 0) -> Decoded:
        from tests.helpers.sampler_data import encode

        keys = np.array([int(x) for x in (self.root / item).read_text().split()], dtype=np.int64)
        return Decoded([{"image": encode(keys[i : i + 1])[0], "label": keys[i] * 3,
                         "pair": np.array([keys[i], -keys[i]], dtype=np.float32)} for i in range(len(keys))])

    def item_path(self, item: str) -> str:
        return str(self.root / item)


class Keyed(Converter):
    name = "keyed"
    payload = "image"
    options: ClassVar[tuple[Any, ...]] = ()

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def scan(self) -> ScanResult:
        return ScanResult(sorted(p.name for p in self.src.iterdir() if p.suffix == ".txt"))

    def record_spec(self) -> FieldSpec:
        return FieldSpec((4, 4, 1), "uint8")

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64"), "pair": FieldSpec((2,), "float32")}

    def labels(self) -> dict[str, list[str]]:
        return {}

    def make_decoder(self) -> Decoder:
        return KeyedDecoder(self.src)


def keyed_corpus(root: Path, keys: range, per_file: int = 3) -> Path:
    """Text files of ``per_file`` consecutive keys each (the last one shorter), named in key order."""
    root.mkdir(parents=True, exist_ok=True)
    ks = list(keys)
    for i in range(0, len(ks), per_file):
        (root / f"{ks[i]:06d}.txt").write_text(" ".join(map(str, ks[i : i + per_file])))
    return root


class DyingDecoder(ImageFolderDecoder):
    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        if "plant" in item[0]:
            os._exit(17)  # a worker process that dies (killed, out of memory) in the middle of a part
        return super().decode(item, start)


class DyingImages(ImageFolderConverter):
    name = "dyingimages"

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def make_decoder(self) -> ImageFolderDecoder:
        return DyingDecoder(self.base, self.image)


class BlockingDecoder(ImageFolderDecoder):
    def __init__(self, base: Path, image: ImageTransform, started: Path) -> None:
        super().__init__(base, image)
        self.started = started

    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        (self.started / str(os.getpid())).touch()
        threading.Event().wait()  # until the process is ended
        raise AssertionError("unreachable")


class BlockingImages(ImageFolderConverter):
    name = "blockingimages"

    @classmethod
    def detect(cls, src: Path) -> bool:
        return False

    def make_decoder(self) -> ImageFolderDecoder:
        started = self.src.parent / "started"
        started.mkdir(exist_ok=True)
        return BlockingDecoder(self.base, self.image, started)
