"""Scanning class-folder corpora (``ROOT/[split/]<class>/<files>``), shared by images and audio.

Rules, the same for both media:

* A class is a sub-directory of the (split) root; names starting with ``.`` or ``_`` are not
  classes (Speech Commands keeps noise in ``_background_noise_``). Label names are the sorted union
  of the class names of *every* split, so a label id means the same class in ``train`` and ``val``
  even when a split lacks a class.
* Every non-hidden entry below a class folder is an input, walked in sorted order, whatever its
  type: files with an unexpected extension, FIFOs, directories named like a media file and broken
  symlinks become skips with a reason instead of silently disappearing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from shardkit.errors import ConfigError, InputFileError
from shardkit.formats import FieldSpec

__all__ = [
    "SPLIT_NAMES",
    "ClassFolderFields",
    "find_splits",
    "choose_split",
    "class_names",
    "scan_class_files",
    "media_share",
]

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


def choose_split(available: list[str], requested: str | None, root: Path) -> str | None:
    """The split to convert: the requested one, else ``train``, else the only one."""
    if requested is not None:
        if requested not in available:
            raise ConfigError(
                f"{root}: --split {requested!r} not found; available: {', '.join(available) or 'none'}"
            )
        return requested
    if not available:
        return None
    if "train" in available:
        return "train"
    if len(available) == 1:
        return available[0]
    raise ConfigError(f"{root}: several splits ({', '.join(available)}); choose one with --split")


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
            rel_dir = Path(dirpath).relative_to(base)
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
                    out.append(((rel_dir / f).as_posix(), label))
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


class ClassFolderFields:
    """What a class-folder converter's records share, whatever the media: the ``label`` field, its
    names (the sorted class folders), input paths relative to ``base`` and the transform's JSON in
    the config, corpus detection by file extensions and the per-file extension check. Subclasses
    set ``media_extensions`` and ``media_name`` (class attributes), ``base``, ``classes`` and
    ``media_transform`` (an object with ``to_json()``), and list this class before
    :class:`~shardkit.converters.base.Converter`.
    """

    media_extensions: ClassVar[frozenset[str]]
    media_name: ClassVar[str]
    base: Path
    classes: list[str]
    media_transform: Any

    @classmethod
    def detect(cls, src: Path) -> bool:
        """A directory whose class folders hold mostly files of this media's extensions."""
        if not src.is_dir():
            return False
        media, total = media_share(src, cls.media_extensions)
        return total > 0 and media * 2 > total

    def checked_path(self, rel: str) -> Path:
        """``base / rel``, or InputFileError when its extension is not one of this media's."""
        path = self.base / rel
        suffix = Path(rel).suffix
        if suffix.lower() not in self.media_extensions:
            raise InputFileError(
                str(path), f"unsupported: file extension {suffix or '(none)'!r} is not an {self.media_name} type"
            )
        return path

    def fields(self) -> dict[str, FieldSpec]:
        return {"label": FieldSpec((), "int64")}

    def labels(self) -> dict[str, list[str]]:
        return {"label": list(self.classes)}

    def transform(self) -> dict[str, Any]:
        return dict(self.media_transform.to_json())

    def config(self) -> dict[str, Any]:
        return {**super().config(), "transform": self.media_transform.to_json(), "classes": self.classes}  # type: ignore[misc]

    def item_path(self, item: tuple[str, int]) -> str:
        return str(self.base / item[0])
