"""Dataset metadata: the ``shardkit`` group attribute and the zarr v3 ``zarr.json`` documents.

shardkit builds and strictly parses these documents itself, without zarr-python (docs/design.md §3).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from shardkit.errors import (
    ChecksumError,
    ConfigError,
    ConversionError,
    DatasetNotFoundError,
    FormatVersionError,
    IncompleteDatasetError,
    NotADatasetError,
)
from shardkit.formats import jsonvalues as jv
from shardkit.formats.checksums import ATTRIBUTES_CRC_KEY, FileDigest, attributes_crc32c, read_object, read_verified
from shardkit.formats.codecs import RecordCodec, codec_from_json
from shardkit.formats.paths import check_name
from shardkit.formats.spec import (
    ATTRS_KEY,
    FORMAT_MINOR,
    FORMAT_VERSION,
    MAX_FIELD_CHUNK_NBYTES,
    MAX_RECORDS_PER_SHARD,
    ZARR_JSON,
    FieldSpec,
    ShardInfo,
    SkippedInput,
    chunk_key,
    format_string,
    index_nbytes,
)
from shardkit.stores import LocalStore, Store
from shardkit.stores.atomic import fsync_dir, write_bytes_atomic

__all__ = ["DatasetMeta", "array_metadata", "group_metadata", "write_json_atomic", "read_json", "read_json_object", "parse_json",
           "read_dataset_meta", "fsync_dir", "MAX_DOCUMENT_NBYTES", "MAX_DOCUMENT_VALUES", "DOCUMENT_PEAK_NBYTES", "check_document_bounds"]

logger = logging.getLogger(__name__)

#: Largest JSON document a reader loads or a writer writes: 64 MiB, about 250,000 shards in the root
#: document (~250 bytes each as shardkit writes them), i.e. 60 TiB of 256 MiB shards.
MAX_DOCUMENT_NBYTES = 64 << 20
#: Most JSON values a document may hold, counted before parsing as its ``[``, ``{``, ``,`` and ``:``
#: bytes. Parsed, one value costs Python up to ~100 bytes: without this bound a 64 MiB document of
#: ``[[]],`` would take ~2.5 GB. A shard entry of the root document is ~15 values.
MAX_DOCUMENT_VALUES = 1 << 22
#: Bound on the peak memory (RSS) of ``shardkit info`` on any ``zarr.json`` (bytes, text, parsed values,
#: interpreter): the worst case within both bounds above peaks at ~0.95 GiB (tests/formats/test_document_bounds.py).
DOCUMENT_PEAK_NBYTES = 1280 << 20
#: Directory (local) or key prefix (object stores) of an unfinished conversion's resume state.
STAGING_NAME = ".shardkit-staging"
#: Directory of the parts of a conversion in parts not committed yet (:mod:`shardkit.formats.outputs`).
PARTS_NAME = ".shardkit-parts"
#: Default records per chunk of the small per-record fields.
DEFAULT_FIELD_CHUNK = 65536


@dataclass(frozen=True)
class DatasetMeta:
    """Everything the group attribute ``shardkit`` says about a dataset.

    The corpus ``kind`` (``coco``, ``audio``, ...), the ``payload`` array's name and one ``record``'s
    shape and dtype; N ``num_records`` in shards of S ``records_per_shard``; the small per-record
    ``fields`` by name, chunked by ``field_chunk`` records (as used: :attr:`field_chunk_records`);
    class names per label field (``labels``); the ``compression`` codec JSON or ``None``; free-form
    ``transform``, ``source`` and ``extra``; inputs ``skipped`` with reasons; every payload shard
    (``shards``: range, size, checksums) and the size and crc32c of every other file (``files``, format
    1.1); ``provenance`` (empty without it); and the format version ``MAJOR.MINOR``.
    """

    kind: str
    payload: str
    record: FieldSpec
    num_records: int
    records_per_shard: int
    fields: dict[str, FieldSpec] = field(default_factory=dict)
    field_chunk: int = DEFAULT_FIELD_CHUNK
    labels: dict[str, list[str]] = field(default_factory=dict)
    compression: dict[str, Any] | None = None
    transform: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: list[SkippedInput] = field(default_factory=list)
    shards: list[ShardInfo] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    created_by: str = ""
    format_minor: int = FORMAT_MINOR
    files: dict[str, FileDigest] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def label_names(self) -> list[str] | None:
        return self.labels.get("label")

    @property
    def codec(self) -> RecordCodec | None:
        return codec_from_json(self.compression)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of all payload shard files."""
        return sum(s.nbytes for s in self.shards)

    @property
    def format(self) -> str:
        """``"1.1"``."""
        return format_string(self.format_version, self.format_minor)

    @property
    def field_chunk_records(self) -> int:
        """Records per chunk of every field array: ``field_chunk``, or N when the dataset is smaller."""
        return max(1, min(self.field_chunk, self.num_records))

    def field_chunk_keys(self, name: str) -> list[str]:
        """Paths (relative to the root) of every chunk of field ``name``."""
        spec = self.fields[name]
        n_chunks = math.ceil(self.num_records / self.field_chunk_records)
        return [chunk_key(name, j, 1 + len(spec.shape)) for j in range(n_chunks)]

    def expected_files(self) -> list[str]:
        """Every path format 1.1 records a digest for: array documents and field chunks."""
        paths = [f"{self.payload}/{ZARR_JSON}"]
        for name in self.fields:
            paths.append(f"{name}/{ZARR_JSON}")
            paths += self.field_chunk_keys(name)
        return paths

    def with_(self, **changes: Any) -> DatasetMeta:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format_version": self.format_version}
        if self.format_minor:
            doc["format_minor"] = self.format_minor
        doc |= {
            "created_by": self.created_by,
            "kind": self.kind,
            "payload": self.payload,
            "record": self.record.to_json(),
            "num_records": self.num_records,
            "records_per_shard": self.records_per_shard,
            "compression": self.compression,
            "fields": {k: v.to_json() for k, v in self.fields.items()},
            "field_chunk": self.field_chunk,
            "labels": self.labels,
            "transform": self.transform,
            "source": self.source,
            "extra": self.extra,
            "skipped": [s.to_json() for s in self.skipped],
            "shards": [s.to_json() for s in self.shards],
        }
        if self.provenance:
            doc["provenance"] = self.provenance
        if self.format_minor >= 1:
            doc["files"] = {k: v.to_json() for k, v in self.files.items()}
            doc[ATTRIBUTES_CRC_KEY] = attributes_crc32c(doc)
        return doc

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str) -> DatasetMeta:
        """Parse and validate the ``shardkit`` attributes read from the document ``where``.

        Raises FormatVersionError for a newer major (a newer minor is read, with a warning),
        ChecksumError when ``attributes_crc32c`` differs, UnsafePathError for a name that is not a
        plain path component, NotADatasetError for any other bad value or a layout that does not add up.
        """
        major = jv.integer(data.get("format_version"), "format_version", where, lo=1)
        if major > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: written with shardkit format version {major}; this shardkit reads up to "
                f"version {FORMAT_VERSION}. Upgrade shardkit."
            )
        minor = jv.integer(data.get("format_minor", 0), "format_minor", where)
        if ATTRIBUTES_CRC_KEY in data:  # checked whatever the version says, so a flipped minor cannot hide it
            recorded = jv.integer(data[ATTRIBUTES_CRC_KEY], ATTRIBUTES_CRC_KEY, where)
            computed = attributes_crc32c(data)
            if recorded != computed:
                raise ChecksumError(
                    f"{where}: the 'shardkit' attributes have crc32c {computed:#010x}, the document records "
                    f"{recorded:#010x}: the dataset metadata was changed or damaged"
                )
        elif minor >= 1:
            raise NotADatasetError(f"{where}: format {format_string(major, minor)} metadata without {ATTRIBUTES_CRC_KEY!r}")
        if minor > FORMAT_MINOR:
            logger.warning(
                "%s: written with format %s, newer than this shardkit's %s; reading it, but checks added "
                "since are not run", where, format_string(major, minor), format_string(FORMAT_VERSION, FORMAT_MINOR),
            )
        meta = _parse_attributes(data, where, major, minor)
        meta.check_layout(where)
        return meta

    def check_layout(self, where: str) -> None:
        """Check that the metadata adds up, before anything is allocated or opened from it."""
        check_name(self.payload, "payload array name", where)
        for name in self.fields:
            check_name(name, "field name", where)
            if name in (self.payload, "key"):
                raise NotADatasetError(f"{where}: field name {name!r} clashes with the payload or 'key'")
        s, n = self.records_per_shard, self.num_records
        if not 1 <= s <= MAX_RECORDS_PER_SHARD:
            raise NotADatasetError(f"{where}: records_per_shard must be in [1, {MAX_RECORDS_PER_SHARD}], found {s}")
        if len(self.shards) != math.ceil(n / s):
            raise NotADatasetError(
                f"{where}: {n} records of {s} per shard need {math.ceil(n / s)} shards, the metadata lists {len(self.shards)}"
            )
        for i, info in enumerate(self.shards):
            self._check_shard(i, info, where)
        for name, spec in self.fields.items():
            if self.field_chunk_records * spec.nbytes > MAX_FIELD_CHUNK_NBYTES:
                raise NotADatasetError(
                    f"{where}: field {name!r}: chunks of {self.field_chunk_records} records of {spec.nbytes} bytes "
                    f"exceed {MAX_FIELD_CHUNK_NBYTES} bytes"
                )
        if self.format_minor >= 1:
            expected = self.expected_files()
            if set(self.files) != set(expected):
                missing = sorted(set(expected) - set(self.files))
                extra = sorted(set(self.files) - set(expected))
                raise NotADatasetError(
                    f"{where}: 'files' must list every array document and field chunk; missing {missing[:5]}, "
                    f"unexpected {extra[:5]}"
                )

    def _check_shard(self, i: int, info: ShardInfo, where: str) -> None:
        s, n = self.records_per_shard, self.num_records
        start, stop = i * s, min((i + 1) * s, n)
        if (info.start, info.stop) != (start, stop):
            raise NotADatasetError(f"{where}: shard {i} must hold records [{start}, {stop}), the metadata says [{info.start}, {info.stop})")
        least = index_nbytes(s) + (info.count * self.record.nbytes if self.compression is None else 0)
        if info.nbytes < least or (self.compression is None and info.nbytes != least):
            raise NotADatasetError(
                f"{where}: shard {i} ({info.path}) is recorded as {info.nbytes} bytes; {info.count} records and "
                f"an index of {s} entries take {'exactly' if self.compression is None else 'at least'} {least}"
            )
        if self.format_minor >= 1 and (info.data_crc32c is None or info.index_crc32c is None):
            raise NotADatasetError(f"{where}: shard {i} has no data_crc32c / index_crc32c (required since format 1.1)")


def _parse_attributes(data: dict[str, Any], where: str, major: int, minor: int) -> DatasetMeta:
    """Build a DatasetMeta from the attributes, every value strictly typed (see :mod:`jsonvalues`)."""

    def get(key: str, default: Any = jv.MISSING) -> Any:
        return jv.member(data, key, where, default)

    compression = get("compression", None)
    if compression is not None:
        try:
            codec_from_json(jv.mapping(compression, "compression", where))
        except ConfigError as exc:
            raise NotADatasetError(f"{where}: compression: {exc}") from None
    labels = jv.mapping(get("labels", {}), "labels", where)
    skipped = jv.array(get("skipped", []), "skipped", where)
    return DatasetMeta(
        format_version=major,
        format_minor=minor,
        created_by=jv.string(get("created_by", ""), "created_by", where),
        kind=jv.string(get("kind"), "kind", where),
        payload=jv.string(get("payload"), "payload", where),
        record=FieldSpec.from_json(get("record"), where=where, what="record"),
        num_records=jv.integer(get("num_records"), "num_records", where),
        records_per_shard=jv.integer(get("records_per_shard"), "records_per_shard", where, lo=1),
        compression=compression,
        fields={
            k: FieldSpec.from_json(v, where=where, what=f"fields.{k}")
            for k, v in jv.mapping(get("fields", {}), "fields", where).items()
        },
        field_chunk=jv.integer(get("field_chunk", DEFAULT_FIELD_CHUNK), "field_chunk", where, lo=1),
        labels={
            k: [jv.string(x, f"labels.{k}[]", where) for x in jv.array(v, f"labels.{k}", where)]
            for k, v in labels.items()
        },
        transform=jv.mapping(get("transform", {}), "transform", where),
        source=jv.mapping(get("source", {}), "source", where),
        extra=jv.mapping(get("extra", {}), "extra", where),
        skipped=[_skipped(x, where) for x in skipped],
        shards=[
            ShardInfo.from_json(x, where=where, what=f"shards[{i}]")
            for i, x in enumerate(jv.array(get("shards", []), "shards", where))
        ],
        files={
            k: FileDigest.from_json(v, where=where, what=f"files[{k!r}]")
            for k, v in jv.mapping(get("files", {}), "files", where).items()
        },
        provenance=jv.mapping(get("provenance", {}), "provenance", where),
    )


def _skipped(value: Any, where: str) -> SkippedInput:
    doc = jv.mapping(value, "skipped[]", where)
    return SkippedInput(
        jv.string(jv.member(doc, "path", where), "skipped[].path", where),
        jv.string(jv.member(doc, "reason", where), "skipped[].reason", where),
    )


def array_metadata(
    *,
    shape: tuple[int, ...],
    dtype: str,
    chunk_shape: tuple[int, ...],
    inner_chunk_shape: tuple[int, ...] | None = None,
    codec: RecordCodec | None = None,
    itemsize: int = 1,
    dimension_names: list[str] | None = None,
    attributes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """zarr v3 array metadata: with ``inner_chunk_shape`` sharded (``chunk_shape`` is the shard shape,
    one record per inner chunk, index at the end with crc32c), else plain chunks; ``bytes`` + codec."""
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    inner: list[dict[str, Any]] = [little] if codec is None else codec.zarr_inner_codecs(itemsize)
    codecs = inner
    if inner_chunk_shape is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner_chunk_shape), "codecs": inner,
            "index_codecs": [little, {"name": "crc32c"}], "index_location": "end"}}]
    meta: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0 if dtype.startswith("float") else 0,
        "codecs": codecs,
        "attributes": attributes or {},
    }
    if dimension_names is not None:
        meta["dimension_names"] = dimension_names
    return meta


def group_metadata(meta: DatasetMeta | None) -> dict[str, Any]:
    """zarr v3 group metadata carrying the ``shardkit`` attribute."""
    attributes = {} if meta is None else {ATTRS_KEY: meta.to_json()}
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def encode_json(document: dict[str, Any]) -> bytes:
    """The bytes shardkit writes for a JSON document (indented, ASCII, trailing newline); ConversionError
    if it exceeds what readers accept (:func:`check_document_bounds`), so none is left unreadable."""
    data = (json.dumps(document, indent=2) + "\n").encode("ascii")
    try:
        check_document_bounds(data, "the document to write")
    except NotADatasetError as exc:
        raise ConversionError(f"{exc}; split the dataset (fewer, larger shards or several datasets)") from None
    return data


def check_document_bounds(raw: bytes, where: str) -> None:
    """NotADatasetError for a JSON document larger than :data:`MAX_DOCUMENT_NBYTES` or of more than
    :data:`MAX_DOCUMENT_VALUES` values, before parsing, so parsing stays within :data:`DOCUMENT_PEAK_NBYTES`."""
    if len(raw) > MAX_DOCUMENT_NBYTES:
        raise NotADatasetError(f"{where}: JSON document of {len(raw)} bytes, more than the {MAX_DOCUMENT_NBYTES} allowed")
    values = 1
    for token in (b"[", b"{", b",", b":"):
        values += raw.count(token)
        if values > MAX_DOCUMENT_VALUES:
            raise NotADatasetError(
                f"{where}: JSON document of more than {MAX_DOCUMENT_VALUES} values (counting '[', '{{', ',' and ':'), "
                "more than a reader parses"
            )


def write_json_atomic(path: Path, document: dict[str, Any], *, durable: bool = True) -> FileDigest:
    """Write a JSON document atomically (:func:`~shardkit.stores.atomic.write_bytes_atomic`: a full disk
    leaves no partial file); returns the size and crc32c of the bytes, for the ``files`` map."""
    data = encode_json(document)
    write_bytes_atomic(path, data, durable=durable)
    return FileDigest.of(data)


def read_json(path: Path, digest: FileDigest | None = None) -> dict[str, Any]:
    """Read a local JSON object document, checked against ``digest`` when the metadata records one
    (ChecksumError, TruncatedShardError); NotADatasetError if too large or not a UTF-8 JSON object."""
    raw = read_verified(path, digest, what="metadata document", max_nbytes=MAX_DOCUMENT_NBYTES)
    return parse_json(raw, str(path))


def read_json_object(store: Store, key: str, digest: FileDigest | None = None) -> dict[str, Any]:
    """:func:`read_json` for the document ``key`` of any store (local or object store)."""
    raw = read_object(store, key, digest, what="metadata document", max_nbytes=MAX_DOCUMENT_NBYTES)
    return parse_json(raw, store.describe(key))


def parse_json(raw: bytes, where: str) -> dict[str, Any]:
    """A JSON object document's bytes as a dict, bounded first (:func:`check_document_bounds`)."""
    check_document_bounds(raw, where)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise NotADatasetError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise NotADatasetError(f"{where}: not UTF-8 JSON") from None
    except RecursionError:
        raise NotADatasetError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise NotADatasetError(f"{where}: not a JSON document shardkit reads ({exc})") from None
    if not isinstance(doc, dict):
        raise NotADatasetError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    return doc


def read_dataset_meta(root: Path | Store, document: str = ZARR_JSON) -> DatasetMeta:
    """Read and validate the dataset metadata of the directory or store ``root``, from its root
    document ``document`` (``zarr.json`` or a kept version's, :mod:`shardkit.formats.versions`).

    Raises DatasetNotFoundError (also a FileNotFoundError) when ``root`` does not exist,
    IncompleteDatasetError after an interrupted write, FormatVersionError for a newer format, and
    NotADatasetError for anything else that is not a shardkit dataset.
    """
    store = root if isinstance(root, Store) else LocalStore(root)
    if store.is_local:
        local = store.local_path()
        if not local.exists():
            raise DatasetNotFoundError(f"{local}: no such dataset directory")
        if not local.is_dir():
            raise NotADatasetError(f"{local}: expected a dataset directory, found a file")
    if document != ZARR_JSON and not store.exists(document):
        raise DatasetNotFoundError(f"{store.describe(document)}: this version of the dataset is not kept "
                                   f"(`shardkit info {store.url}` lists the versions kept)")
    if store.is_local and not store.exists(document):
        _raise_missing_root(store)
    try:  # in an object store one GET: a missing document is told from its answer, not a HEAD first
        raw = read_object(store, document, what="metadata document", max_nbytes=MAX_DOCUMENT_NBYTES)
    except FileNotFoundError:
        _raise_missing_root(store)
    return parse_dataset_meta(raw, store.describe(document))


def parse_dataset_meta(raw: bytes, where: str) -> DatasetMeta:
    """The dataset metadata in the root document's bytes ``raw`` (read from ``where``), validated as
    :func:`read_dataset_meta` does: for a reader that also fingerprints the same bytes."""
    doc = parse_json(raw, where)
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise NotADatasetError(
            f"{where}: expected a zarr v3 group, found zarr_format={doc.get('zarr_format')!r} "
            f"node_type={doc.get('node_type')!r}"
        )
    attributes = doc.get("attributes", {})
    attrs = attributes.get(ATTRS_KEY) if isinstance(attributes, dict) else None
    if not isinstance(attrs, dict):
        raise NotADatasetError(f"{where}: a zarr group without 'shardkit' attributes")
    return DatasetMeta.from_json(attrs, where=where)


def _raise_missing_root(store: Store) -> NoReturn:
    """No root document: an interrupted conversion, nothing at all, or something else."""
    if store.is_local:
        local = store.local_path()
        # A conversion's staging area, an array document or chunks of an array: a write was cut short.
        started = (local / STAGING_NAME).exists() or (local / PARTS_NAME).exists() or any(local.glob(f"*/{ZARR_JSON}")) \
            or any(local.glob("*/c"))
    else:
        # One listing (at most a page) tells an empty prefix from an interrupted upload.
        keys = (meta.key for meta in store.list(""))
        first = next(keys, None)
        if first is None:
            raise DatasetNotFoundError(f"{store.url}: no such dataset (nothing stored under this prefix)")
        started = any(k.startswith((f"{STAGING_NAME}/", f"{PARTS_NAME}/")) or k.endswith(f"/{ZARR_JSON}") or "/c/" in k
                      for k in itertools.chain([first], keys))  # fmt: skip
    if started:
        raise IncompleteDatasetError(f"{store.url}: incomplete dataset (no {ZARR_JSON} group metadata; a conversion was "
                                     "interrupted — re-run it to resume)")
    raise NotADatasetError(f"{store.url}: not a shardkit dataset (no {ZARR_JSON})")
