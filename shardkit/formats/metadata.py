"""Dataset metadata: the ``shardkit`` group attribute and the zarr v3 ``zarr.json`` documents.

We write zarr's JSON documents ourselves (they are small and fully specified) rather than through
zarr-python, because zarr-python would also create the root group document as a side effect, and the
root document must appear *last*: its presence with a ``shardkit`` attribute is what marks a dataset
complete. Interoperability tests prove that zarr-python reads what we write.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardkit.errors import DatasetNotFoundError, FormatVersionError, IncompleteDatasetError, NotADatasetError
from shardkit.formats.codecs import RecordCodec, codec_from_json
from shardkit.formats.spec import (
    ATTRS_KEY,
    FORMAT_VERSION,
    ZARR_JSON,
    FieldSpec,
    ShardInfo,
    SkippedInput,
)

__all__ = [
    "DatasetMeta",
    "array_metadata",
    "group_metadata",
    "write_json_atomic",
    "read_json",
    "read_dataset_meta",
    "fsync_dir",
]


@dataclass(frozen=True)
class DatasetMeta:
    """Everything the group attribute ``shardkit`` says about a dataset.

    Attributes
    ----------
    kind
        Corpus kind that produced it (``coco``, ``imagefolder``, ``cifar10``, ``audio``, ...).
    payload
        Name of the payload array (``image`` or ``audio``).
    record
        Shape and dtype of one payload record.
    num_records, records_per_shard
        Total records N and records per shard S.
    fields
        Small per-record fields (``label``, ``boxes``, ...) by name.
    field_chunk
        Records per zarr chunk of the small fields.
    labels
        Class names per label field (``{"label": [...], "coarse_label": [...]}``).
    compression
        Codec JSON (``{"name": "zstd", "level": 3}``) or ``None`` for uncompressed records.
    transform, source, extra
        Free-form provenance: the transform applied, where the data came from, kind-specific data.
    skipped
        Inputs that did not become records, with reasons.
    shards
        Every payload shard file: record range, size, checksum.
    """

    kind: str
    payload: str
    record: FieldSpec
    num_records: int
    records_per_shard: int
    fields: dict[str, FieldSpec] = field(default_factory=dict)
    field_chunk: int = 65536
    labels: dict[str, list[str]] = field(default_factory=dict)
    compression: dict[str, Any] | None = None
    transform: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: list[SkippedInput] = field(default_factory=list)
    shards: list[ShardInfo] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    created_by: str = ""

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

    def with_(self, **changes: Any) -> DatasetMeta:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
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

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str) -> DatasetMeta:
        version = data.get("format_version")
        if not isinstance(version, int):
            raise NotADatasetError(f"{where}: 'shardkit' attributes have no integer format_version")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: written with shardkit format version {version}; this shardkit reads up to "
                f"version {FORMAT_VERSION}. Upgrade shardkit."
            )
        try:
            return cls(
                format_version=version,
                created_by=str(data.get("created_by", "")),
                kind=str(data["kind"]),
                payload=str(data["payload"]),
                record=FieldSpec.from_json(data["record"]),
                num_records=int(data["num_records"]),
                records_per_shard=int(data["records_per_shard"]),
                compression=data.get("compression"),
                fields={k: FieldSpec.from_json(v) for k, v in data.get("fields", {}).items()},
                field_chunk=int(data.get("field_chunk", 65536)),
                labels={k: list(v) for k, v in data.get("labels", {}).items()},
                transform=dict(data.get("transform", {})),
                source=dict(data.get("source", {})),
                extra=dict(data.get("extra", {})),
                skipped=[SkippedInput(str(s["path"]), str(s["reason"])) for s in data.get("skipped", [])],
                shards=[ShardInfo.from_json(s) for s in data.get("shards", [])],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise NotADatasetError(f"{where}: malformed 'shardkit' attributes ({exc!r})") from None


def _zarr_dtype_and_fill(dtype: str) -> tuple[str, int | float]:
    return dtype, (0.0 if dtype.startswith("float") else 0)


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
    """zarr v3 array metadata.

    With ``inner_chunk_shape`` the array is sharded: ``chunk_shape`` is the shard shape and every
    inner chunk (one record) is encoded with ``bytes`` (+ the codec), index at the end with crc32c.
    Without it the array is a plain chunked array with ``bytes`` (+ the codec).
    """
    data_type, fill = _zarr_dtype_and_fill(dtype)
    inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if codec is not None:
        inner += codec.zarr_codecs(itemsize)
    if inner_chunk_shape is not None:
        codecs: list[dict[str, Any]] = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_chunk_shape),
                    "codecs": inner,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ]
    else:
        codecs = inner
    meta: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
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


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, document: dict[str, Any], *, durable: bool = True) -> None:
    """Write JSON to ``path.partial``, fsync, rename over ``path``: readers never see half a file.

    ``durable=False`` skips the fsyncs (scratch data such as SSD-tier reservoirs, which are worthless
    after a crash anyway); the rename still makes the document appear atomically.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(document, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        if durable:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON document, turning a syntax error into a NotADatasetError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as exc:
        raise NotADatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise NotADatasetError(f"{path}: not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise NotADatasetError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return doc


def read_dataset_meta(root: Path) -> DatasetMeta:
    """Read and validate the dataset metadata of the directory ``root``.

    Raises
    ------
    DatasetNotFoundError
        ``root`` does not exist (also a ``FileNotFoundError``).
    IncompleteDatasetError
        The directory has payload data but no final group metadata (an interrupted write).
    NotADatasetError
        Anything else that is not a shardkit dataset.
    FormatVersionError
        Written by a newer format version.
    """
    root = Path(root)
    if not root.exists():
        raise DatasetNotFoundError(f"{root}: no such dataset directory")
    if not root.is_dir():
        raise NotADatasetError(f"{root}: expected a dataset directory, found a file")
    doc_path = root / ZARR_JSON
    if not doc_path.exists():
        # A conversion's staging area, an array document or chunks of an array: a write was cut short.
        if (root / ".shardkit-staging").exists() or any(root.glob(f"*/{ZARR_JSON}")) or any(root.glob("*/c")):
            raise IncompleteDatasetError(
                f"{root}: incomplete dataset (no {ZARR_JSON} group metadata; a conversion was "
                "interrupted — re-run it to resume)"
            )
        raise NotADatasetError(f"{root}: not a shardkit dataset (no {ZARR_JSON})")
    doc = read_json(doc_path)
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise NotADatasetError(
            f"{doc_path}: expected a zarr v3 group, found zarr_format={doc.get('zarr_format')!r} "
            f"node_type={doc.get('node_type')!r}"
        )
    attrs = doc.get("attributes", {}).get(ATTRS_KEY)
    if not isinstance(attrs, dict):
        raise NotADatasetError(f"{doc_path}: a zarr group without 'shardkit' attributes")
    return DatasetMeta.from_json(attrs, where=str(doc_path))
