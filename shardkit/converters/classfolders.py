"""Scanning class-folder corpora (``ROOT/[split/]<class>/<files>``), shared by images and audio.

A class is a sub-directory of the (split) root not starting with ``.`` or ``_``; label names are the
sorted union of every split's classes, so an id means the same class in each. Every non-hidden entry
below a class folder is an input, in sorted order, whatever its type (a wrong extension, a FIFO, a
broken symlink becomes a skip with a reason); a class folder with no media file is logged by name.
"""

from __future__ import annotations

import logging
import os
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from shardkit.converters.base import Converter, Decoder
from shardkit.errors import ConfigError, ConversionError, InputFileError
from shardkit.formats import FieldSpec

__all__ = [
    "SPLIT_NAMES",
    "ClassFolderConverter",
    "ClassFolderDecoder",
    "find_splits",
    "choose_split",
    "class_names",
    "scan_class_files",
    "media_share",
]

logger = logging.getLogger(__name__)

#: Directory names that mark a split layout.
SPLIT_NAMES = ("train", "val", "valid", "validation", "test")


def _visible_dirs(path: Path) -> list[str]:
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []
    return [e.name for e in entries if e.is_dir() and not e.name.startswith((".", "_"))]


def find_splits(root: Path) -> list[str]:
    """Split directories directly under ``root`` (empty list: no split layout)."""
    return [d for d in _visible_dirs(root) if d in SPLIT_NAMES]


def choose_split(available: list[str], requested: str | None, root: Path, label: str = "split") -> str | None:
    """The split to convert: the requested one, else ``train``, else the only one."""
    if requested is not None:
        if requested not in available:
            raise ConfigError(
                f"{root}: {label} {requested!r} not found; available: {', '.join(available) or 'none'}"
            )
        return requested
    if not available:
        return None
    if "train" in available:
        return "train"
    if len(available) == 1:
        return available[0]
    raise ConfigError(f"{root}: several splits ({', '.join(available)}); choose one with {label}")


def class_names(root: Path, splits: list[str]) -> list[str]:
    """Sorted union of class folder names over ``splits`` (or ``root`` itself when no split layout)."""
    names: set[str] = set()
    for base in [root / s for s in splits] if splits else [root]:
        names.update(_visible_dirs(base))
    return sorted(names)


def scan_class_files(base: Path, classes: list[str], media_exts: Iterable[str]) -> list[tuple[str, int]]:
    """Every input below ``base/<class>/`` as ``(path relative to base, label)``, in sorted order."""
    exts = frozenset(media_exts)
    out: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        cdir = base / name
        if not cdir.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(cdir):
            rel_dir = Path(dirpath).relative_to(base).as_posix()  # strings per file: a Path each cost the serial scan
            keep_dirs = []
            entries = list(filenames)
            for d in dirnames:
                if d.startswith("."):
                    continue
                if Path(d).suffix.lower() in exts:
                    entries.append(d)  # a directory named like a media file is an (unreadable) input
                else:
                    keep_dirs.append(d)
            dirnames[:] = sorted(keep_dirs)
            for f in sorted(entries):
                if not f.startswith("."):
                    out.append((f"{rel_dir}/{f}", label))
    return out


def media_share(root: Path, exts: Iterable[str], limit: int = 200) -> tuple[int, int]:
    """``(media files, all files)`` among the first ``limit`` files of class folders of ``root``."""
    exts = frozenset(exts)
    splits = find_splits(root)
    bases = [root / s for s in splits] if splits else [root]
    media = total = 0
    for base in bases:
        for cls in _visible_dirs(base):
            for _dirpath, dirnames, filenames in os.walk(base / cls):
                dirnames.sort()
                for f in sorted(filenames):
                    if f.startswith("."):
                        continue
                    total += 1
                    media += Path(f).suffix.lower() in exts
                    if total >= limit:
                        return media, total
    return media, total


class ClassFolderDecoder(Decoder):
    """The worker half of a class-folder kind: items are ``(path relative to base, label)``."""

    def __init__(self, payload: str, record: FieldSpec, base: Path, extensions: frozenset[str], media_name: str) -> None:
        super().__init__(payload, record)
        self.base = base
        self.extensions = extensions
        self.media_name = media_name

    def checked_path(self, rel: str) -> Path:
        """``base / rel``, or InputFileError when its extension is not one of this media's."""
        path = self.base / rel
        suffix = Path(rel).suffix
        if suffix.lower() not in self.extensions:
            raise InputFileError(
                str(path), f"unsupported: file extension {suffix or '(none)'!r} is not an {self.media_name} type"
            )
        return path

    def item_path(self, item: tuple[str, int]) -> str:
        # Called per input by the serial steps (fingerprint, provenance names): joined as strings, no Path each.
        return os.path.join(self.base, item[0])


class ClassFolderConverter(Converter):
    """A corpus of class folders, whatever the media: the ``label`` field and its names, inputs in
    sorted order, detection by extension. Subclasses set :attr:`media_extensions` and :attr:`media_name`,
    implement :meth:`media_transform` and :meth:`make_decoder`, and may override :meth:`layout`."""

    #: Extensions (lower case, with the dot) of this media's files.
    media_extensions: ClassVar[frozenset[str]] = frozenset()
    #: ``"image"`` or ``"audio"``, in skip reasons.
    media_name: ClassVar[str] = ""

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        self.split, self.base, self.classes = self.layout()
        self.values["split"] = self.split
        if not self.classes:
            raise ConversionError(
                f"{self.base}: no class folders found (expected {self.base}/<class>/<{self.media_name} files>)"
            )

    def layout(self) -> tuple[str | None, Path, list[str]]:
        """``(split, base directory, class names)`` from split directories (``train/``, ``val/``...)."""
        splits = find_splits(self.src)
        split = choose_split(splits, self.values.get("split"), self.src, self.label("split"))
        return split, self.src / split if split else self.src, class_names(self.src, splits)

    @classmethod
    def detect(cls, src: Path) -> bool:
        """A directory whose class folders hold mostly files of this media's extensions."""
        if not src.is_dir():
            return False
        media, total = media_share(src, cls.media_extensions)
        return total > 0 and media * 2 > total

    def scan_files(self) -> list[tuple[str, int]]:
        """Every input below the class folders of :attr:`base` (a class folder holding none of this
        kind's files is logged as a warning: it would silently become a class without records)."""
        items = scan_class_files(self.base, self.classes, self.media_extensions)
        self._warn_empty_classes(items)
        return items

    def _warn_empty_classes(self, items: list[tuple[str, int]]) -> None:
        media: Counter[int] = Counter()
        others: Counter[int] = Counter()
        for rel, label in items:
            (media if os.path.splitext(rel)[1].lower() in self.media_extensions else others)[label] += 1
        empty = [k for k, name in enumerate(self.classes) if (self.base / name).is_dir() and not media[k]]
        if not empty:
            return
        shown = ", ".join(f"{self.classes[k]}/ ({others[k]} other file{'s' if others[k] != 1 else ''})" for k in empty[:5])
        hint = "is --kind right?" if self.naming == "cli" else "is the kind right?"
        try:
            from shardkit.converters.registry import detect_kind

            detected = detect_kind(self.src)
        except ConversionError:
            detected = self.name
        if detected != self.name:
            hint = (f"{self.src} looks like a {detected} corpus: pass --kind {detected}" if self.naming == "cli"
                    else f"{self.src} looks like a {detected} corpus: pass kind={detected!r}")
        logger.warning(
            "%s: %d of %d class folders hold no %s files and give classes without records: %s%s; %s",
            self.base, len(empty), len(self.classes), self.media_name, shown, ", ..." if len(empty) > 5 else "", hint,
        )

    @abstractmethod
    def media_transform(self) -> Any:
        """The media transform (an object with ``to_json()``), stored in the metadata and config."""

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        return {"label": list(self.classes)}

    def transform(self) -> dict[str, Any]:
        return dict(self.media_transform().to_json())

    def config(self) -> dict[str, Any]:
        return {**super().config(), "transform": self.media_transform().to_json(), "classes": self.classes}
