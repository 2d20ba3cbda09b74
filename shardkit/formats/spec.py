"""The on-disk format, version 1.1 (docs/design.md §3): names, constants and the value objects that
describe it, pure data shared by readers and writers so the layout is described exactly once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardkit.errors import NotADatasetError, SchemaError
from shardkit.formats import jsonvalues as jv

__all__ = ["FORMAT_VERSION", "FORMAT_MINOR", "ATTRS_KEY", "ZARR_JSON", "INDEX_ENTRY_NBYTES", "CHECKSUM_NBYTES", "EMPTY_ENTRY",
           "DEFAULT_SHARD_BYTES",
           "INDEX_SHARE", "MAX_NDIM", "MAX_RECORD_NBYTES", "MAX_RECORDS_PER_SHARD", "MAX_FIELD_CHUNK_NBYTES", "MAX_CRC32C",
           "TAIL_SAMPLE_NBYTES", "FieldSpec", "ShardInfo", "SkippedInput", "chunk_key", "index_nbytes", "records_per_shard_for",
           "format_string"]

#: Major version of the layout described in this module. Readers refuse a newer major.
FORMAT_VERSION = 1
#: Minor version: what this shardkit writes. Readers accept a newer minor with a warning.
FORMAT_MINOR = 1
#: Key of the group attribute that holds shardkit's metadata.
ATTRS_KEY = "shardkit"
#: Name of zarr v3's metadata document in every node directory.
ZARR_JSON = "zarr.json"
#: One index entry is two little-endian uint64: (offset, nbytes) of an inner chunk (= one record).
INDEX_ENTRY_NBYTES = 16
#: The index is followed by its crc32c (zarr's ``crc32c`` index codec), 4 bytes little-endian.
CHECKSUM_NBYTES = 4
#: zarr marks an inner chunk that was never written with offset = nbytes = 2**64 - 1.
EMPTY_ENTRY = np.uint64(2**64 - 1)
#: Default target size of one payload shard file: large enough that a pass over a shard is one long
#: sequential read, small enough that a writer's shard buffer and a verify pass stay cheap.
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
#: The default records per shard keep a shard's index (16 bytes a slot, full size even in a partly
#: filled last shard, as zarr's sharding codec requires) at most ``1 / INDEX_SHARE`` of the shard size:
#: at most one slot per 4 KiB of ``shard_bytes``, 65,536 slots (a 1 MiB index) for 256 MiB shards.
INDEX_SHARE = 256

# Bounds on sizes read from metadata, far above any real dataset: a hostile document fails with a
# named error before a reader allocates from it, not with a MemoryError after.
#: Dimensions of one record (numpy allows 64).
MAX_NDIM = 32
#: Bytes of one record of any field: 1 GiB (an hour of 48 kHz float32 stereo audio is 1.4 GB; one
#: record is a training example, and a sampler holds thousands of them in RAM).
MAX_RECORD_NBYTES = 1 << 30
#: Records per shard readers accept: the index (16 bytes a record) is read whole, so it stays <= 1 GiB
#: (datasets written before the :data:`INDEX_SHARE` default had up to 16 M slots a shard).
MAX_RECORDS_PER_SHARD = 1 << 26
#: Decoded bytes of one chunk of a small per-record field (a decode buffer).
MAX_FIELD_CHUNK_NBYTES = 1 << 30
#: Largest crc32c value.
MAX_CRC32C = 2**32 - 1
#: Bytes at the end of a shard's records whose crc32c is recorded as its ``tail_crc32c`` (see
#: :class:`ShardInfo`): read with the index in the same request, so the identity check is free.
TAIL_SAMPLE_NBYTES = 4096
#: numpy dtype kinds a field may have: bool, signed, unsigned, float, complex (zarr v3's numeric types).
_NUMERIC_KINDS = "biufc"


def format_string(major: int, minor: int) -> str:
    """``"1.1"``: how a version is shown to people."""
    return f"{major}.{minor}"


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one field of a record (the payload or a small per-record field).

    ``shape`` is the field's for ONE record (``()`` for a scalar such as ``label``): every dimension
    positive, at most :data:`MAX_NDIM`, at most :data:`MAX_RECORD_NBYTES` bytes in all. ``dtype`` is a
    numeric numpy dtype string (``"uint8"``, ``"int64"``, ``"float32"``); anything else is a SchemaError.
    """

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise SchemaError(f"unknown dtype {self.dtype!r}") from None
        if dtype.kind not in _NUMERIC_KINDS:
            raise SchemaError(f"field dtype must be numeric (bool, int, uint, float, complex), found {dtype}")
        object.__setattr__(self, "dtype", dtype.name)
        if any(s <= 0 for s in self.shape):
            raise SchemaError(f"field shape must be positive in every dimension, found {self.shape}")
        if len(self.shape) > MAX_NDIM:
            raise SchemaError(f"field shape has {len(self.shape)} dimensions, at most {MAX_NDIM} are supported")
        if self.nbytes > MAX_RECORD_NBYTES:
            raise SchemaError(
                f"one record of shape {self.shape} {self.dtype} is {self.nbytes} bytes, more than the "
                f"{MAX_RECORD_NBYTES} bytes (1 GiB) a record may have"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of one record of this field when stored uncompressed."""
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, *, where: str, what: str = "field") -> FieldSpec:
        """Parse ``{"shape": [...], "dtype": "..."}`` strictly (NotADatasetError naming ``where``)."""
        doc = jv.mapping(data, what, where)
        shape = jv.shape(jv.member(doc, "shape", where), f"{what}.shape", where, max_ndim=MAX_NDIM, hi=MAX_RECORD_NBYTES)
        dtype = jv.string(jv.member(doc, "dtype", where), f"{what}.dtype", where)
        try:
            return cls(shape=shape, dtype=dtype)
        except SchemaError as exc:
            raise NotADatasetError(f"{where}: {what}: {exc}") from None

    def check(self, name: str, values: np.ndarray, count: int) -> np.ndarray:
        """Return ``values`` as a C-contiguous array of ``count`` records, or raise SchemaError."""
        arr = np.asarray(values)
        expected = (count, *self.shape)
        if arr.shape != expected:
            raise SchemaError(f"field {name!r}: expected shape {expected}, found {arr.shape}")
        if arr.dtype != np.dtype(self.dtype):
            if not np.can_cast(arr.dtype, self.dtype, casting="same_kind"):
                raise SchemaError(f"field {name!r}: expected dtype {self.dtype}, found {arr.dtype}")
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr)


@dataclass(frozen=True)
class ShardInfo:
    """What the group metadata records about one payload shard file (checksums: docs/design.md §3).

    ``path`` is the payload array's chunk key (nothing else is accepted), ``[start, stop)`` its global
    record range, ``nbytes`` its exact size (``-1`` for a bare zarr array). ``crc32c`` covers the whole
    file (format 1.0), ``data_crc32c`` the records and ``index_crc32c`` the index entries (1.1; ``None``
    in 1.0), ``tail_crc32c`` the last :meth:`tail_nbytes` bytes of the records (``None`` if older).
    """

    path: str
    start: int
    stop: int
    nbytes: int
    crc32c: int
    data_crc32c: int | None = None
    index_crc32c: int | None = None
    tail_crc32c: int | None = None

    @property
    def count(self) -> int:
        return self.stop - self.start

    @staticmethod
    def tail_nbytes(data_nbytes: int) -> int:
        """Bytes covered by ``tail_crc32c`` in a shard of ``data_nbytes`` bytes of records."""
        return max(0, min(TAIL_SAMPLE_NBYTES, data_nbytes))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Any, *, where: str = "shard", what: str = "shard") -> ShardInfo:
        """Parse one entry of ``shards`` strictly (NotADatasetError naming ``where``)."""
        doc = jv.mapping(data, what, where)

        def crc(key: str) -> int:
            return jv.integer(jv.member(doc, key, where), f"{what}.{key}", where, hi=MAX_CRC32C)

        start = jv.integer(jv.member(doc, "start", where), f"{what}.start", where)
        return cls(
            path=jv.string(jv.member(doc, "path", where), f"{what}.path", where),
            start=start,
            stop=jv.integer(jv.member(doc, "stop", where), f"{what}.stop", where, lo=start),
            nbytes=jv.integer(jv.member(doc, "nbytes", where), f"{what}.nbytes", where, lo=CHECKSUM_NBYTES),
            crc32c=crc("crc32c"),
            data_crc32c=crc("data_crc32c") if "data_crc32c" in doc else None,
            index_crc32c=crc("index_crc32c") if "index_crc32c" in doc else None,
            tail_crc32c=crc("tail_crc32c") if "tail_crc32c" in doc else None,
        )


@dataclass(frozen=True)
class SkippedInput:
    """An input file a converter did not turn into a record, and why."""

    path: str
    reason: str
    cursor: int = field(default=-1, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


def chunk_key(array_name: str, shard_index: int, ndim: int, separator: str = "/") -> str:
    """zarr v3 ``default`` chunk key of chunk ``shard_index`` along axis 0, under ``array_name/``."""
    return array_name + "/" + separator.join(["c", str(shard_index), *(["0"] * (ndim - 1))])


def index_nbytes(records_per_shard: int) -> int:
    """Bytes of a shard's index including its crc32c."""
    return records_per_shard * INDEX_ENTRY_NBYTES + CHECKSUM_NBYTES


def records_per_shard_for(record_nbytes: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Records per shard so that an uncompressed shard file is about ``shard_bytes`` bytes and its index
    at most ``shard_bytes / INDEX_SHARE`` (one slot per 4 KiB): ``min(shard_bytes // (record + 16),
    shard_bytes // 4096)``, at least 1 and at most :data:`MAX_RECORDS_PER_SHARD`.

    The index has an entry for every slot, filled or not, so without the second bound tiny records
    gave millions of slots and a dataset of a few records a shard of hundreds of MiB of index.
    """
    if record_nbytes <= 0:
        raise SchemaError(f"record size must be positive, found {record_nbytes} bytes")
    if shard_bytes <= 0:
        raise SchemaError(f"shard size must be positive, found {shard_bytes} bytes")
    by_size = shard_bytes // (record_nbytes + INDEX_ENTRY_NBYTES)
    by_index = shard_bytes // (INDEX_SHARE * INDEX_ENTRY_NBYTES)
    return max(1, min(MAX_RECORDS_PER_SHARD, by_size, by_index))
