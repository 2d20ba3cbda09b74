"""The converter seam: :class:`Converter` (the main-process half) and :class:`Decoder` (the worker half).

A corpus kind is one module with a :class:`Converter` subclass, named in the registry
(:mod:`shardkit.converters.registry`); this module knows no kind. :meth:`Converter.scan` returns the
input sequence, whose order alone fixes the record order; a small picklable :class:`Decoder` turns one
input into records in a worker, or raises :class:`~shardkit.errors.InputFileError` (a skip). Why two
halves: docs/design.md §2, §5.
"""

from __future__ import annotations

import functools
import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shardkit.converters.options import Option, OptionNaming, parse_options
from shardkit.declare import option_name
from shardkit.errors import ConfigError, DatasetNotFoundError
from shardkit.formats import FieldSpec
from shardkit.formats.provenance import BASE_COLUMNS, PROVENANCE_FIELD, ProvenanceSpec
from shardkit.stores.url import is_url, location_string

__all__ = [
    "Converter",
    "Decoder",
    "Decoded",
    "InputNames",
    "Note",
    "Record",
    "ScanResult",
    "Skip",
    "MAX_RECORDS_PER_INPUT",
    "PROVENANCE",
    "RECORD_BYTES_PER_CALL",
    "reason_category",
]

#: Record key under which a decoder gives the record's provenance columns (a ``{column: int}`` dict
#: for :attr:`Converter.provenance_columns`); the pipeline adds each record's input and part number.
PROVENANCE = PROVENANCE_FIELD

#: One record as produced by :meth:`Decoder.decode`: the payload and every declared field.
Record = dict[str, Any]

#: Most records one input may give (an audio file cut into windows): a resume cursor keeps the
#: record number inside its input in 20 bits (see :func:`shardkit.converters.pipeline.input_cursor`).
MAX_RECORDS_PER_INPUT = (1 << 20) - 1
#: A decode call returns about this many bytes of records at most (at least one record); an input
#: with more says so with :attr:`Decoded.more` and is continued by further calls, so one long
#: recording never has to be held in memory whole.
RECORD_BYTES_PER_CALL = 4 << 20


@dataclass(frozen=True)
class Skip:
    """An input found unusable while scanning, with its reason: a short category, ``": "``, then the
    detail (``"missing: ..."``); the summary counts skips by category."""

    path: str
    reason: str


@dataclass(frozen=True)
class Note:
    """Something worth reporting about a decoded input that is not a skip (a COCO image whose
    boxes were capped): counted by ``category`` in the summary, logged with ``detail``."""

    category: str
    detail: str

    def __str__(self) -> str:
        return f"{self.category}: {self.detail}"


@dataclass(frozen=True)
class Decoded:
    """Records ``start, start + 1, ...`` of one input, as returned by :meth:`Decoder.decode`; with
    ``more`` the pipeline asks for the next ones (``start=start + len(records)``) before the next
    input. ``notes`` are reported once per call."""

    records: list[Record]
    start: int = 0
    more: bool = False
    notes: tuple[Note, ...] = ()

    @property
    def next_start(self) -> int | None:
        """The ``start`` of the next call for this input, or ``None`` when it is done."""
        return self.start + len(self.records) if self.more else None


@dataclass
class ScanResult:
    """What :meth:`Converter.scan` found: the input sequence (work items in record order, any indexable
    sequence with ``len``) and problems that are not items of it (COCO annotations for unknown images)."""

    items: Sequence[Any]
    skipped: list[Skip] = field(default_factory=list)


def reason_category(reason: str) -> str:
    """The category of a skip reason: the text before the first ``": "``."""
    head, sep, _ = reason.partition(": ")
    return head if sep else reason


class InputNames(Sequence[str]):
    """The names of ``count`` inputs, made one at a time by ``name_of(index)`` (a corpus of millions
    never holds them all)."""

    def __init__(self, count: int, name_of: Callable[[int], str]) -> None:
        self.size, self.name_of = count, name_of

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -self.size <= i < self.size:
            raise IndexError(f"input {i} of {self.size}")  # ends iteration (the sequence protocol)
        return self.name_of(i % self.size)


class Decoder(ABC):
    """Decode work items into records (payload ``payload`` of spec ``record``); runs in worker
    processes, so it must stay small and picklable."""

    def __init__(self, payload: str, record: FieldSpec) -> None:
        self.payload = payload
        self.record = record

    @abstractmethod
    def decode(self, item: Any, start: int = 0) -> Decoded:
        """Records ``start, start + 1, ...`` of ``item`` (at most about :data:`RECORD_BYTES_PER_CALL`
        bytes, with :attr:`Decoded.more` when records remain); raise ``InputFileError`` to skip it."""

    @abstractmethod
    def item_path(self, item: Any) -> str:
        """Human-readable name of an item, used in skip reasons and ``--strict`` errors."""

    def input_files(self, item: Any) -> Sequence[str]:
        """Local files that decoding ``item`` reads whole: the engine asks the kernel to read them ahead
        of the decode (:func:`~shardkit.converters.decoding.announce_inputs`), so a decode does not wait
        for its file's first read. Empty (the default) when the decoder reads in parts or remotely."""
        return ()


class Converter(ABC):
    """Turn one corpus kind into records (the main-process half; see the module docstring).

    Subclasses set :attr:`name`, :attr:`payload`, :attr:`options` and implement the abstract methods.

    Parameters
    ----------
    src
        Corpus root directory (or file, for kinds that accept one), resolved to an absolute path.
    naming
        How errors name options: ``"python"`` (``sample_rate``) or ``"cli"`` (``--sample-rate``).
    **options
        Kind-specific options (see :attr:`options`), each parsed by its :class:`Option`.
    """

    #: Registry name of the kind (``--kind``).
    name: ClassVar[str] = ""
    #: Name of the payload array: ``"image"`` or ``"audio"``.
    payload: ClassVar[str] = ""
    #: Every option the kind accepts: name, type, default and help (the CLI is generated from it).
    options: ClassVar[tuple[Option, ...]] = ()
    #: When several kinds recognise a corpus, the highest priority wins (a COCO image folder also
    #: looks like class folders; an annotation file is the more specific evidence).
    detect_priority: ClassVar[int] = 0
    #: Fewest items per task sent to a worker (more when their records are small: ``decoding.task_inputs``).
    chunk_size: ClassVar[int] = 4
    #: What one input is called in progress bars.
    progress_unit: ClassVar[str] = "item"
    #: Every input gives at most one record (then a corpus smaller than a shard gets a smaller shard).
    one_record_per_input: ClassVar[bool] = False
    #: What a conversion that wrote nothing suggests checking.
    nothing_hint: ClassVar[str] = "is --kind right?"
    #: The kind's own provenance columns, after ``input`` and ``part``: each record's decoder output
    #: holds an integer for each under :data:`PROVENANCE` (missing ones are stored as 0).
    provenance_columns: ClassVar[tuple[str, ...]] = ()

    def __init__(self, src: str | Path, *, naming: OptionNaming = "python", **options: Any) -> None:
        if isinstance(src, str) and is_url(src):
            raise ConfigError(f"{location_string(src)}: the {self.name} kind reads a local corpus; of the object-store "
                              "sources, shardkit converts WebDataset shards (kind webdataset)")
        src = Path(src)
        if not src.exists():
            raise DatasetNotFoundError(f"{src}: corpus not found")
        self.src = src.resolve()
        self.naming: OptionNaming = naming
        #: The parsed options, every one of :attr:`options` present (defaults filled in).
        self.values: dict[str, Any] = parse_options(self.name, self.options, options, naming)

    @property
    def records_follow_inputs(self) -> bool:
        """Inputs are expected to give one record each, so that a part's first record can be guessed
        from its first input (docs/design.md §5, "One engine"; a wrong guess costs a re-pack of the
        part's shards, never a wrong byte): kinds with :attr:`one_record_per_input`."""
        return bool(self.one_record_per_input)

    def label(self, option: str) -> str:
        """``option`` as the user wrote it (``--sample-rate`` on the CLI, ``sample_rate`` in Python)."""
        return option_name(option, self.naming)

    # ------------------------------------------------------------------ detection
    @classmethod
    @abstractmethod
    def detect(cls, src: Path) -> bool:
        """True if ``src`` looks like a corpus of this kind (cheap: listings only)."""

    @classmethod
    def detect_url(cls, url: str) -> bool:
        """True if this kind reads the object-store URL ``url`` (from its text alone; most kinds read
        local corpora only)."""
        return False

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

    @abstractmethod
    def make_decoder(self) -> Decoder:
        """The worker half: a small picklable :class:`Decoder` for the items of :meth:`scan`."""

    @functools.cached_property
    def decoder(self) -> Decoder:
        """:meth:`make_decoder`, built once."""
        return self.make_decoder()

    def transform(self) -> dict[str, Any]:
        """Transform parameters stored in the metadata."""
        return {}

    def source(self) -> dict[str, Any]:
        """Where the data came from, stored in the metadata."""
        return {"path": str(self.src), "kind": self.name, "split": self.values.get("split")}

    def extra(self) -> dict[str, Any]:
        """Kind-specific metadata (category ids, ...)."""
        return {}

    def config(self) -> dict[str, Any]:
        """Every parameter that shapes the output; a resume with a different config is refused."""
        return {"kind": self.name, "src": str(self.src), "options": dict(sorted(self.values.items()))}

    def source_location(self) -> str:
        """Where workers find the corpus: its absolute path, or the object-store URL it is read from."""
        return str(self.src)

    def describe(self) -> str:
        """How messages name what is converted: the corpus path (``shardkit.write``: its function)."""
        return str(self.src)

    def item_path(self, item: Any) -> str:
        """Human-readable name of an item (the decoder's)."""
        return self.decoder.item_path(item)

    # ------------------------------------------------------------------ provenance
    def source_root(self) -> Path | str:
        """The directory input names are relative to (the corpus root; a URL for an object-store corpus)."""
        return self.src

    def input_name(self, item: Any) -> str:
        """The name of an item stored in the provenance table: its path relative to
        :meth:`source_root` (``train/cat/001.jpg``), or the whole path when it lies elsewhere."""
        path = self.item_path(item)
        root = str(self.source_root())
        if path.startswith(root + os.sep):
            return path[len(root) + 1 :]
        return path

    def provenance_spec(self, scan: ScanResult) -> ProvenanceSpec:
        """What the writer stores about every record's source (names are made lazily, at commit)."""
        columns = (*BASE_COLUMNS, *self.provenance_columns)
        return ProvenanceSpec(
            columns=columns,
            root=str(self.source_root()),
            inputs=self.input_names(scan.items),
            summarize=lambda values: self.summarize_changes(columns, values),
        )

    def input_names(self, items: Sequence[Any]) -> Sequence[str]:
        """:meth:`input_name` of every item, made one at a time when asked for."""
        return InputNames(len(items), lambda i: self.input_name(items[i]))

    def summarize_changes(self, columns: Sequence[str], values: np.ndarray) -> dict[str, Any]:
        """Counts of what conversion changed over the whole provenance field ``values`` (the metadata's
        ``provenance.changes``); another kind than image or audio may count its own."""
        from shardkit.converters.provenance import summarize

        return summarize(self.payload, self.transform(), columns, values)

    def inputs_fingerprint(self, scan: ScanResult) -> str:
        """Fingerprint of the input sequence, stored in the config: a resume counts inputs by position,
        so it is refused when the corpus changed. By default the crc32 of the item names."""

        crc = 0
        for i in range(len(scan.items)):
            crc = zlib.crc32(self.item_path(scan.items[i]).encode("utf-8", "surrogateescape") + b"\n", crc)
        for s in scan.skipped:
            crc = zlib.crc32(f"{s.path}\t{s.reason}\n".encode("utf-8", "surrogateescape"), crc)
        return f"{len(scan.items)}:{crc:08x}"

