"""The registry of corpus kinds: a name maps to ``"module:Class"``, imported only when needed.

Built-in kinds are in :data:`BUILTIN`; a package adds one through the entry-point group
:data:`ENTRY_POINT_GROUP` (``librispeech = "shardkit_librispeech:LibriSpeechConverter"``), code with
:func:`register`. :func:`detect_kind` and the CLI import every kind, logging (not raising) a plugin
that fails to import (docs/design.md §2).
"""

from __future__ import annotations

import functools
import importlib
import logging
from importlib import metadata
from pathlib import Path

from shardkit.converters.base import Converter
from shardkit.converters.options import Option
from shardkit.errors import ConfigError, ConversionError, DatasetNotFoundError
from shardkit.stores.url import is_url, location_string

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "RESERVED_OPTIONS",
    "available_kinds",
    "detect_kind",
    "get_converter",
    "kind_options",
    "register",
]

logger = logging.getLogger(__name__)

#: Entry-point group through which other packages add corpus kinds.
ENTRY_POINT_GROUP = "shardkit.converters"
#: The built-in kinds.
BUILTIN: dict[str, str] = {
    "audio": "shardkit.converters.audio:AudioFolderConverter",
    "cifar10": "shardkit.converters.cifar:Cifar10Converter",
    "cifar100": "shardkit.converters.cifar:Cifar100Converter",
    "coco": "shardkit.converters.coco:CocoConverter",
    "imagefolder": "shardkit.converters.imagefolder:ImageFolderConverter",
    "webdataset": "shardkit.converters.webdataset:WebDatasetConverter",
    "parquet": "shardkit.converters.parquet:ParquetConverter",
    "mds": "shardkit.converters.mds:MdsConverter",
    "litdata": "shardkit.converters.litdata:LitDataConverter",
}
#: Option names a kind may not use: keywords of ``convert()`` and flags of ``shardkit convert``.
RESERVED_OPTIONS = frozenset({
    "src", "out", "output", "kind", "workers", "strict", "overwrite", "compression", "shard_bytes",
    "shard_size", "records_per_shard", "progress", "naming", "quiet", "verbose", "help",
    "executor", "scheduler", "append", "part_size", "keep_versions",
})

#: Kinds added with :func:`register`: name -> class or ``"module:Class"``.
_ADDED: dict[str, type[Converter] | str] = {}
#: Imported kinds.
_LOADED: dict[str, type[Converter]] = {}


@functools.lru_cache(maxsize=1)
def _plugins() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Kinds declared by entry points: ``({name: target}, {name: [conflicting targets]})``."""
    found: dict[str, str] = {}
    conflicts: dict[str, list[str]] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        if ep.name in BUILTIN:
            logger.warning("entry point %s = %s ignored: %r is a built-in corpus kind", ep.name, ep.value, ep.name)
        elif ep.name in found and found[ep.name] != ep.value:
            conflicts.setdefault(ep.name, [found[ep.name]]).append(ep.value)
        else:
            found[ep.name] = ep.value
    return found, conflicts


def _targets() -> dict[str, type[Converter] | str]:
    plugins, _ = _plugins()
    return {**plugins, **BUILTIN, **_ADDED}


def register(kind: type[Converter] | str, target: type[Converter] | str | None = None, *, replace: bool = False) -> None:
    """Add a corpus kind: ``register(MyConverter)`` (named by its ``name``) or
    ``register("name", "module:Class")`` (imported when first used).

    The class must subclass :class:`~shardkit.converters.base.Converter`, have ``name`` equal to its
    registry name and no option in :data:`RESERVED_OPTIONS`; ConfigError when the name is taken
    (unless ``replace=True``).
    """
    if isinstance(kind, str):
        if target is None:
            raise ConfigError(f"register({kind!r}): expected a class or a 'module:Class' target")
        name = kind
    else:
        name, target = kind.name, kind
    if not name:
        raise ConfigError(f"{target!r}: a corpus kind needs a non-empty name")
    current = _targets().get(name)
    if current is not None and current != target and not replace:
        raise ConfigError(f"corpus kind {name!r} is already registered as {_show(current)}; pass replace=True")
    _ADDED[name] = target
    _LOADED.pop(name, None)


def _show(target: type[Converter] | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _import(name: str, target: type[Converter] | str) -> type[Converter]:
    if isinstance(target, str):
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"corpus kind {name!r}: target {target!r} is not 'module:Class'")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # a plugin may fail in any way while importing
            raise ConfigError(f"corpus kind {name!r}: cannot load {target} ({type(exc).__name__}: {exc})") from None
    else:
        obj = target
    if not (isinstance(obj, type) and issubclass(obj, Converter)):
        raise ConfigError(f"corpus kind {name!r}: {_show(target)} is not a Converter subclass")
    if obj.name != name:
        raise ConfigError(f"corpus kind {name!r}: {_show(target)} is named {obj.name!r}")
    taken = sorted({o.name for o in obj.options} & RESERVED_OPTIONS)
    if taken:
        raise ConfigError(f"corpus kind {name!r}: option(s) {', '.join(taken)} clash with convert's own options")
    return obj


def available_kinds() -> list[str]:
    """Names of every known corpus kind (built-in, entry points, registered), none imported."""
    return sorted(_targets())


def get_converter(name: str) -> type[Converter]:
    """The converter class of kind ``name``, imported on first use; ConfigError for an unknown kind
    (naming the known ones), one claimed by two entry points, or one that fails to import or is not a converter."""

    if name in _LOADED:
        return _LOADED[name]
    targets = _targets()
    _, conflicts = _plugins()
    if name in conflicts and name not in _ADDED:
        raise ConfigError(
            f"corpus kind {name!r} is declared by several entry points ({', '.join(conflicts[name])}); "
            "uninstall one of the packages"
        )
    if name not in targets:
        raise ConfigError(f"unknown corpus kind {name!r}; expected one of {', '.join(sorted(targets))}")
    cls = _import(name, targets[name])
    _LOADED[name] = cls
    return cls


def _loadable() -> list[tuple[str, type[Converter]]]:
    """Every kind that imports; a failing plugin is logged and left out."""
    out = []
    for name in available_kinds():
        try:
            out.append((name, get_converter(name)))
        except ConfigError as exc:
            if name in BUILTIN:
                raise
            logger.warning("%s", exc)
    return out


def kind_options() -> dict[str, list[tuple[str, Option]]]:
    """Every option of every kind: ``{option name: [(kind, option), ...]}`` (for the CLI)."""
    table: dict[str, list[tuple[str, Option]]] = {}
    for name, cls in _loadable():
        for opt in cls.options:
            table.setdefault(opt.name, []).append((name, opt))
    return table


def _detects(name: str, cls: type[Converter], src: Path) -> bool:
    """``cls.detect(src)``; a plugin whose detection fails is logged and counts as no match."""
    if name in BUILTIN:
        return cls.detect(src)
    try:
        return bool(cls.detect(src))
    except Exception as exc:  # a plugin may fail in any way
        logger.warning("corpus kind %s: detection failed (%s: %s)", name, type(exc).__name__, exc)
        return False


def detect_kind(src: str | Path) -> str:
    """Guess the corpus kind of ``src``; ``ConversionError`` if none or several match."""
    if isinstance(src, str) and is_url(src):
        by_url = [name for name, cls in _loadable() if cls.detect_url(src)]
        if len(by_url) != 1:
            raise ConversionError(f"{location_string(src)}: " + (
                f"looks like several kinds ({', '.join(by_url)}); pass --kind" if by_url else
                "no corpus kind reads this URL (object stores hold WebDataset shards: s3://bucket/shards-{000..009}.tar, "
                "s3://bucket/prefix/ or one .tar)"))
        return by_url[0]
    src = Path(src)
    matches = [(cls.detect_priority, name) for name, cls in _loadable() if _detects(name, cls, src)]
    if not matches and not src.exists():  # a kind may accept a name that is no file (a brace pattern)
        raise DatasetNotFoundError(f"{src}: corpus not found")
    if not matches:
        raise ConversionError(
            f"{src}: could not recognise the corpus kind (expected COCO annotations/instances_*.json, "
            "class folders of images or audio, CIFAR python batches, WebDataset .tar shards or .parquet files); pass --kind"
        )
    top = max(p for p, _ in matches)
    found = [name for p, name in matches if p == top]
    if len(found) > 1:
        raise ConversionError(f"{src}: looks like several kinds ({', '.join(found)}); pass --kind")
    logger.info("%s: detected corpus kind %s", src, found[0])
    return found[0]
