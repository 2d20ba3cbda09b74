"""The converter seam: the :class:`Converter` ABC, the registry of corpus kinds and kind detection.

A corpus kind is one module that subclasses :class:`Converter` and decorates it with
:func:`register`. The pipeline (:mod:`shardkit.converters.pipeline`) only talks to this interface,
so adding a kind never touches the pipeline, the CLI or the other kinds.

A converter splits its work in two halves so that decoding can run in worker processes while the
output stays deterministic:

* :meth:`Converter.scan` runs once in the calling process. It reads directory listings and
  annotation files and returns the *input sequence*: an ordered, indexable sequence of small
  picklable work items. Its order alone fixes the order of the records.
* :meth:`Converter.decode` runs in a worker for one item and returns that item's records (an
  image gives one, an audio file cut into windows may give several) or raises
  :class:`~shardkit.errors.InputFileError`, which becomes a skip with its reason.
"""

from __future__ import annotations

import logging
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shardkit.errors import ConfigError, ConversionError, DatasetNotFoundError
from shardkit.formats import FieldSpec

__all__ = [
    "Converter",
    "ScanResult",
    "Skip",
    "register",
    "get_converter",
    "available_kinds",
    "detect_kind",
    "reason_category",
]

logger = logging.getLogger(__name__)

#: One record as produced by :meth:`Converter.decode`: the payload and every declared field.
Record = dict[str, np.ndarray | np.generic]


@dataclass(frozen=True)
class Skip:
    """An input found unusable while scanning (before any decode), with its reason.

    ``reason`` always starts with a short category followed by ``": "`` (``"missing: ..."``); the
    summary counts skips by that category, the metadata keeps the full text.
    """

    path: str
    reason: str


@dataclass
class ScanResult:
    """What :meth:`Converter.scan` found.

    Attributes
    ----------
    items
        The input sequence: work items in record order (any indexable sequence with ``len``).
    skipped
        Problems found while scanning that are not items of the sequence (for example COCO
        annotations for unknown images); they are reported once, with the first shard.
    """

    items: Sequence[Any]
    skipped: list[Skip] = field(default_factory=list)


def reason_category(reason: str) -> str:
    """The category of a skip reason: the text before the first ``": "``."""
    head, sep, _ = reason.partition(": ")
    return head if sep else reason


class Converter(ABC):
    """Turn one corpus kind into records.

    Subclasses set :attr:`name`, :attr:`payload`, :attr:`option_defaults`, implement the abstract
    methods, and are registered with :func:`register`.

    Parameters
    ----------
    src
        Corpus root directory (or file, for kinds that accept one).
    **options
        Kind-specific options; unknown names are a :class:`~shardkit.errors.ConfigError`.
    """

    #: Registry name of the kind (``--kind``).
    name: ClassVar[str] = ""
    #: Name of the payload array: ``"image"`` or ``"audio"``.
    payload: ClassVar[str] = ""
    #: Every option the kind accepts, with its default.
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: When several kinds recognise a corpus, the highest priority wins (a COCO image folder also
    #: looks like class folders; an annotation file is the more specific evidence).
    detect_priority: ClassVar[int] = 0
    #: Items per task sent to a worker: enough to amortise inter-process overhead.
    chunk_size: ClassVar[int] = 4

    def __init__(self, src: str | Path, **options: Any) -> None:
        self.src = Path(src)
        if not self.src.exists():
            raise DatasetNotFoundError(f"{self.src}: corpus not found")
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            raise ConfigError(
                f"kind {self.name!r} does not accept option(s) {', '.join(unknown)}; "
                f"expected some of: {', '.join(sorted(self.option_defaults))}"
            )
        merged = dict(self.option_defaults)
        merged.update({k: v for k, v in options.items() if v is not None})
        self.options: dict[str, Any] = merged

    # ------------------------------------------------------------------ detection
    @classmethod
    @abstractmethod
    def detect(cls, src: Path) -> bool:
        """True if ``src`` looks like a corpus of this kind (cheap: listings only)."""

    # ------------------------------------------------------------------ main-process half
    @abstractmethod
    def scan(self) -> ScanResult:
        """Read listings/annotations and return the ordered input sequence."""

    @abstractmethod
    def record_spec(self) -> FieldSpec:
        """Shape and dtype of one payload record."""

    @abstractmethod
    def fields(self) -> dict[str, FieldSpec]:
        """Small per-record fields (always including ``label``)."""

    @abstractmethod
    def labels(self) -> dict[str, list[str]]:
        """Class names per label field."""

    @property
    def kind(self) -> str:
        """Kind stored in the dataset metadata (may be refined by :meth:`scan`, e.g. cifar100)."""
        return self.name

    def transform(self) -> dict[str, Any]:
        """Transform parameters stored in the metadata."""
        return {}

    def source(self) -> dict[str, Any]:
        """Where the data came from, stored in the metadata."""
        return {"path": str(self.src.resolve()), "kind": self.kind, "split": self.options.get("split")}

    def extra(self) -> dict[str, Any]:
        """Kind-specific metadata (category ids, ...)."""
        return {}

    def config(self) -> dict[str, Any]:
        """Every parameter that shapes the output; a resume with a different config is refused."""
        return {"kind": self.kind, "src": str(self.src.resolve()), "options": dict(sorted(self.options.items()))}

    def item_path(self, item: Any) -> str:
        """Human-readable name of an item, used in skip reasons and ``--strict`` errors."""
        return str(item)

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """Fingerprint of the input sequence, stored in the config.

        A resume counts inputs by position, so it must be refused when the corpus changed in
        between (a file added or removed shifts every position). By default: crc32 of the item
        names; kinds whose names do not capture the content (annotation files, batches) extend it.
        """
        crc = 0
        for i in range(len(scan.items)):
            crc = zlib.crc32(self.item_path(scan.items[i]).encode("utf-8", "surrogateescape") + b"\n", crc)
        for s in scan.skipped:
            crc = zlib.crc32(f"{s.path}\t{s.reason}\n".encode("utf-8", "surrogateescape"), crc)
        return f"{len(scan.items)}:{crc:08x}"

    # ------------------------------------------------------------------ worker half
    @abstractmethod
    def decode(self, item: Any) -> list[Record]:
        """Decode one item into its records; raise ``InputFileError`` to skip it."""


_REGISTRY: dict[str, type[Converter]] = {}


def register(cls: type[Converter]) -> type[Converter]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name:
        raise ConfigError(f"{cls.__qualname__}: a converter needs a non-empty name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ConfigError(f"converter name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    # Importing the modules registers the built-in kinds.
    from shardkit.converters import audio, cifar, coco, imagefolder  # noqa: F401


def available_kinds() -> list[str]:
    """Names of every registered corpus kind."""
    _load_builtin()
    return sorted(_REGISTRY)


def get_converter(name: str) -> type[Converter]:
    """The converter class registered as ``name`` (``ConfigError`` naming the known kinds)."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown corpus kind {name!r}; expected one of {', '.join(sorted(_REGISTRY))}") from None


def detect_kind(src: str | Path) -> str:
    """Guess the corpus kind of ``src``; ``ConversionError`` if none or several match."""
    src = Path(src)
    if not src.exists():
        raise DatasetNotFoundError(f"{src}: corpus not found")
    _load_builtin()
    matches = [(cls.detect_priority, name) for name, cls in sorted(_REGISTRY.items()) if cls.detect(src)]
    if not matches:
        raise ConversionError(
            f"{src}: could not recognise the corpus kind (expected COCO annotations/instances_*.json, "
            "class folders of images or audio, or CIFAR python batches); pass --kind"
        )
    top = max(p for p, _ in matches)
    found = [name for p, name in matches if p == top]
    if len(found) > 1:
        raise ConversionError(f"{src}: looks like several kinds ({', '.join(found)}); pass --kind")
    logger.info("%s: detected corpus kind %s", src, found[0])
    return found[0]
