"""Where every record came from: a per-record provenance field and a table of input names, so
``shardkit info PATH --record K`` answers long after the corpus is gone (docs/design.md §3, *Provenance*).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import NotADatasetError, SchemaError
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import FileDigest
from shardkit.formats.codecs import get_codec
from shardkit.formats.fields import read_field_rows, write_field_arrays
from shardkit.formats.metadata import DatasetMeta
from shardkit.formats.spec import ZARR_JSON, FieldSpec, chunk_key
from shardkit.stores import LocalStore, Store

__all__ = ["PROVENANCE_FIELD", "NAMES_ARRAY", "ENDS_ARRAY", "TABLE_ARRAYS", "BASE_COLUMNS", "MAX_NAME_NBYTES", "ProvenanceSpec",
           "Provenance", "RecordSource", "write_provenance", "encode_name", "decode_name"]

#: Name of the per-record provenance field.
PROVENANCE_FIELD = "provenance"
#: Array of every input name's UTF-8 bytes, back to back.
NAMES_ARRAY = "provenance_names"
#: Array of the end offset of each input name in :data:`NAMES_ARRAY`.
ENDS_ARRAY = "provenance_ends"
#: The arrays of the input table (written with the metadata, like the field arrays).
TABLE_ARRAYS = (NAMES_ARRAY, ENDS_ARRAY)
#: Columns every provenance field starts with: the input's number and the record's number inside it.
BASE_COLUMNS = ("input", "part")
#: Longest input name accepted when reading (Linux paths stop at 4 KiB; COCO file names are short).
MAX_NAME_NBYTES = 1 << 16
#: Bytes per chunk of the names array, and records per chunk of the ends array.
_NAMES_CHUNK = 1 << 20
_ENDS_CHUNK = 1 << 16
_COLUMN_NAME_MAX = 64


def encode_name(name: str) -> bytes:
    """UTF-8 bytes of an input name; undecodable file names (surrogate escapes) keep their bytes."""
    return name.encode("utf-8", "surrogateescape")


def decode_name(raw: bytes) -> str:
    """The inverse of :func:`encode_name`."""
    return raw.decode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class ProvenanceSpec:
    """What a :class:`~shardkit.formats.DatasetWriter` is given to store provenance: the field's
    ``columns`` (starting with :data:`BASE_COLUMNS`), the corpus ``root`` the ``inputs`` names are
    relative to (read once, at commit, so a lazy sequence is fine), and ``summarize``, which turns the
    whole field ``[N, C]`` into the metadata's ``changes`` counts (``None``: no counts)."""

    columns: tuple[str, ...]
    root: str
    inputs: Sequence[str]
    summarize: Callable[[np.ndarray], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.columns[: len(BASE_COLUMNS)] != BASE_COLUMNS:
            raise SchemaError(f"provenance columns must start with {list(BASE_COLUMNS)}, found {list(self.columns)}")
        if len(set(self.columns)) != len(self.columns):
            raise SchemaError(f"provenance columns must be distinct, found {list(self.columns)}")

    @property
    def field_spec(self) -> FieldSpec:
        """Shape and dtype of the per-record field."""
        return FieldSpec((len(self.columns),), "int64")


def write_provenance(root: Path | Store, spec: ProvenanceSpec, values: np.ndarray, *, durable: bool = True) -> dict[str, Any]:
    """Write the input table under ``root`` (a directory or a store) and return the metadata's ``provenance``
    block, its ``changes`` computed from ``values``, the whole per-record field ``[N, C]``."""
    parts = [encode_name(name) for name in spec.inputs]
    ends = np.cumsum([len(raw) for raw in parts], dtype=np.int64)
    names = np.frombuffer(b"".join(parts), dtype=np.uint8)
    codec = get_codec("zstd")
    names_chunk = max(1, min(_NAMES_CHUNK, names.size))
    ends_chunk = max(1, min(_ENDS_CHUNK, ends.size))
    files = write_field_arrays(root, [(NAMES_ARRAY, FieldSpec((), "uint8"), names, names_chunk, 0),
                                      (ENDS_ARRAY, FieldSpec((), "int64"), ends, ends_chunk, 0)], codec, durable=durable)
    return {
        "field": PROVENANCE_FIELD,
        "columns": list(spec.columns),
        "root": spec.root,
        "inputs": {"count": int(ends.size), "nbytes": int(names.size), "names_chunk": names_chunk, "ends_chunk": ends_chunk},
        "files": {k: v.to_json() for k, v in files.items()},
        "changes": {} if spec.summarize is None else spec.summarize(values),
    }


@dataclass(frozen=True)
class RecordSource:
    """Where record ``record`` came from: input number ``input`` (skipped inputs count), named ``name``
    relative to the corpus ``root`` at conversion time (``train/cat/001.jpg``, ``data_batch_3#417``),
    and every provenance column's value (``input``, ``part`` and the kind's own)."""

    record: int
    input: int
    name: str
    root: str
    values: dict[str, int]

    @property
    def path(self) -> str:
        """The input's full name as it was at conversion time."""
        return os.path.join(self.root, self.name) if self.root else self.name


@dataclass(frozen=True)
class Provenance:
    """The parsed ``provenance`` block of a dataset's metadata (:meth:`from_meta`), and lookups in its table."""

    field: str
    columns: tuple[str, ...]
    root: str
    count: int
    nbytes: int
    names_chunk: int
    ends_chunk: int
    files: Mapping[str, FileDigest]
    changes: Mapping[str, Any]

    @classmethod
    def from_meta(cls, meta: DatasetMeta, *, where: str) -> Provenance | None:
        """The block of ``meta`` (``None`` when the dataset has none); NotADatasetError for a bad value or
        a field that is not a declared ``int64 [C]`` field with one entry per column."""
        doc = meta.provenance
        if not doc:
            return None
        name = jv.string(jv.member(doc, "field", where), "provenance.field", where)
        columns = tuple(jv.string(c, "provenance.columns[]", where)
                        for c in jv.array(jv.member(doc, "columns", where), "provenance.columns", where))
        if columns[: len(BASE_COLUMNS)] != BASE_COLUMNS or any(not c or len(c) > _COLUMN_NAME_MAX for c in columns):
            raise NotADatasetError(f"{where}: provenance.columns must start with {list(BASE_COLUMNS)}, found {list(columns)[:8]}")
        spec = meta.fields.get(name)
        if spec is None or spec != FieldSpec((len(columns),), "int64"):
            raise NotADatasetError(
                f"{where}: provenance.field {name!r} must be a declared int64 field of {len(columns)} columns, "
                f"found {None if spec is None else spec.to_json()}"
            )
        inputs = jv.mapping(jv.member(doc, "inputs", where), "provenance.inputs", where)
        count = jv.integer(jv.member(inputs, "count", where), "provenance.inputs.count", where, hi=2**62)
        nbytes = jv.integer(jv.member(inputs, "nbytes", where), "provenance.inputs.nbytes", where, hi=2**62)
        files = {
            k: FileDigest.from_json(v, where=where, what=f"provenance.files[{k!r}]")
            for k, v in jv.mapping(jv.member(doc, "files", where), "provenance.files", where).items()
        }
        prov = cls(
            field=name,
            columns=columns,
            root=jv.string(jv.member(doc, "root", where, ""), "provenance.root", where),
            count=count,
            nbytes=nbytes,
            names_chunk=jv.integer(jv.member(inputs, "names_chunk", where), "provenance.inputs.names_chunk", where,
                                   lo=1, hi=_NAMES_CHUNK),
            ends_chunk=jv.integer(jv.member(inputs, "ends_chunk", where), "provenance.inputs.ends_chunk", where,
                                  lo=1, hi=_ENDS_CHUNK),
            files=files,
            changes=jv.mapping(jv.member(doc, "changes", where, {}), "provenance.changes", where),
        )
        # Count before listing: a block claiming 2**60 bytes in chunks of one byte must fail here, not
        # while building a list of 2**60 chunk names.
        chunks = -(-prov.nbytes // prov.names_chunk) + -(-prov.count // prov.ends_chunk)
        if chunks + len(TABLE_ARRAYS) != len(files):
            raise NotADatasetError(
                f"{where}: provenance.files lists {len(files)} files; {prov.count} inputs of {prov.nbytes} bytes "
                f"in the recorded chunks need {chunks + len(TABLE_ARRAYS)}"
            )
        expected = set(prov.expected_files())
        if set(files) != expected:
            raise NotADatasetError(
                f"{where}: provenance.files must list the input table's files; missing "
                f"{sorted(expected - set(files))[:5]}, unexpected {sorted(set(files) - expected)[:5]}"
            )
        return prov

    def expected_files(self) -> list[str]:
        """Every file of the input table (documents and chunks), relative to the dataset root."""
        out = []
        for name, n, chunk in ((NAMES_ARRAY, self.nbytes, self.names_chunk), (ENDS_ARRAY, self.count, self.ends_chunk)):
            out.append(f"{name}/{ZARR_JSON}")
            out += [chunk_key(name, j, 1) for j in range(math.ceil(n / chunk))]
        return out

    def values(self, root: Path | Store, meta: DatasetMeta, start: int, stop: int) -> np.ndarray:
        """The provenance field of records ``[start, stop)`` of the dataset at ``root``."""
        return read_field_rows(root, self.field, meta.fields[self.field], meta.num_records, meta.field_chunk_records,
                               meta.files, start, stop)

    def input_name(self, root: Path | Store, index: int) -> str:
        """The name of input ``index`` (else IndexError), reading one chunk of each table array;
        NotADatasetError or CorruptShardError for a table that contradicts itself or its digests."""
        store = root if isinstance(root, Store) else LocalStore(root)
        if not 0 <= index < self.count:
            raise IndexError(f"{store.describe('')}: input {index} outside the {self.count} inputs of the provenance table")
        lo = max(0, index - 1)
        ends = read_field_rows(store, ENDS_ARRAY, FieldSpec((), "int64"), self.count, self.ends_chunk, self.files, lo, index + 1)
        begin = 0 if index == 0 else int(ends[0])
        end = int(ends[-1])
        if not 0 <= begin <= end <= self.nbytes or end - begin > MAX_NAME_NBYTES:
            raise NotADatasetError(
                f"{store.describe(ENDS_ARRAY)}: input {index} would span bytes [{begin}, {end}) of {self.nbytes} "
                f"(names are at most {MAX_NAME_NBYTES} bytes)"
            )
        raw = read_field_rows(store, NAMES_ARRAY, FieldSpec((), "uint8"), self.nbytes, self.names_chunk, self.files, begin, end)
        return decode_name(raw.tobytes())

    def names(self, root: Path | Store) -> list[str]:
        """The name of every input, in order (both table arrays read whole)."""
        store = root if isinstance(root, Store) else LocalStore(root)
        ends = read_field_rows(store, ENDS_ARRAY, FieldSpec((), "int64"), self.count, self.ends_chunk, self.files)
        raw = read_field_rows(store, NAMES_ARRAY, FieldSpec((), "uint8"), self.nbytes, self.names_chunk, self.files)
        starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
        if np.any(starts > ends) or (ends.size and not 0 <= int(ends[-1]) <= self.nbytes):
            raise NotADatasetError(f"{store.describe(ENDS_ARRAY)}: input name ends are not increasing within the table")
        return [decode_name(raw[a:b].tobytes()) for a, b in zip(starts.tolist(), ends.tolist())]

    def source(self, root: Path | Store, meta: DatasetMeta, record: int) -> RecordSource:
        """Where record ``record`` came from (its provenance values and its input's name)."""
        store = root if isinstance(root, Store) else LocalStore(root)
        if not 0 <= record < meta.num_records:
            raise IndexError(f"{store.describe('')}: record {record} outside [0, {meta.num_records})")
        row = self.values(store, meta, record, record + 1)[0]
        values = {c: int(v) for c, v in zip(self.columns, row)}
        if not 0 <= values["input"] < self.count:
            raise NotADatasetError(
                f"{store.describe(self.field)}: record {record} says it came from input {values['input']}, but the "
                f"provenance table holds {self.count} inputs"
            )
        return RecordSource(record, values["input"], self.input_name(store, values["input"]), self.root, values)
