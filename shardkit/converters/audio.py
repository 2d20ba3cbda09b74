"""Audio class-folder corpora, Speech-Commands style: ``ROOT/<word>/<clip>.{wav,flac,ogg}``.

Splits come either from split directories (``ROOT/train/<word>/...``) or, Speech-Commands style,
from ``validation_list.txt`` / ``testing_list.txt`` (paths relative to ROOT, one a line): split
``validation`` (alias ``val``) and ``test`` (alias ``testing``) are the listed files, ``train`` is
every other file, ``all`` is everything. Without ``--split`` a corpus with lists converts ``train``.

Record: ``audio`` int16 or float32 ``[T]`` (mono) or ``[T, C]``, and ``label`` int64. With
``window=True`` one file may give several records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.audio_transforms import AUDIO_EXTENSIONS, AudioTransform
from shardkit.converters.base import Converter, Record, ScanResult, register
from shardkit.converters.classfolders import (
    ClassFolderFields,
    choose_split,
    class_names,
    find_splits,
    scan_class_files,
)
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import FieldSpec

__all__ = ["AudioFolderConverter"]

_LISTS = {"validation": "validation_list.txt", "test": "testing_list.txt"}
_ALIASES = {"val": "validation", "valid": "validation", "testing": "test"}


@register
class AudioFolderConverter(ClassFolderFields, Converter):
    """Convert class folders of audio clips into fixed-length records."""

    name = "audio"
    payload = "audio"
    media_extensions = frozenset(AUDIO_EXTENSIONS)
    media_name = "audio"
    option_defaults = {
        "split": None,
        "sample_rate": 16000,
        "duration": 1.0,
        "channels": 1,
        "window": False,
        "dtype": "int16",
    }
    chunk_size = 16

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        o = self.options
        self.audio = AudioTransform(
            int(o["sample_rate"]), float(o["duration"]), int(o["channels"]), bool(o["window"]), str(o["dtype"])
        )
        self.lists = {name: self.src / f for name, f in _LISTS.items() if (self.src / f).is_file()}
        split_dirs = find_splits(self.src)
        requested = o.get("split")
        if self.lists and not split_dirs:
            split = _ALIASES.get(requested, requested) if requested else "train"
            if split not in ("train", "validation", "test", "all"):
                raise ConfigError(f"{self.src}: --split expected train, validation, test or all, found {requested!r}")
            self.split, self.base, self.list_mode = split, self.src, True
            self.classes = class_names(self.src, [])
        else:
            self.split = choose_split(split_dirs, requested, self.src)
            self.base = self.src / self.split if self.split else self.src
            self.list_mode = False
            self.classes = class_names(self.src, split_dirs)
        o["split"] = self.split
        if not self.classes:
            raise ConversionError(f"{self.base}: no class folders found (expected {self.base}/<label>/<audio files>)")

    def _listed(self, name: str) -> set[str]:
        path = self.lists.get(name)
        if path is None:
            return set()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{path}: cannot read the split list: {exc}") from None
        return {line.strip().replace("\\", "/") for line in text.splitlines() if line.strip()}

    def scan(self) -> ScanResult:
        items = scan_class_files(self.base, self.classes, AUDIO_EXTENSIONS)
        if self.list_mode and self.split != "all":
            val, test = self._listed("validation"), self._listed("test")
            if self.split == "validation":
                items = [it for it in items if it[0] in val]
            elif self.split == "test":
                items = [it for it in items if it[0] in test]
            else:
                items = [it for it in items if it[0] not in val and it[0] not in test]
        if not items:
            raise ConversionError(f"{self.base}: no files for split {self.split!r}")
        return ScanResult(items=items)

    @property
    def media_transform(self) -> Any:
        return self.audio

    def record_spec(self) -> FieldSpec:
        return FieldSpec(self.audio.shape, self.audio.dtype)

    def decode(self, item: tuple[str, int]) -> list[Record]:
        rel, label = item
        path = self.checked_path(rel)
        return [{"audio": clip, "label": np.int64(label)} for clip in self.audio.load(path)]
