"""The on-disk format, version 1: names, constants and the value objects that describe it.

A shardkit dataset is a directory that *is* a zarr v3 group::

    DATASET/
      zarr.json                 group metadata; attributes["shardkit"] lists everything (written last)
      image/zarr.json           payload array metadata (sharding_indexed codec)
      image/c/<i>/0/0/0         payload shard i: S records | index (S x [offset, nbytes] u64 LE) | crc32c
      label/zarr.json, label/c/0 ...   small per-record fields, ordinary zarr arrays

Everything here is pure data: no I/O. Readers and writers share these definitions so that the
layout is described exactly once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardkit.errors import SchemaError

__all__ = [
    "FORMAT_VERSION",
    "ATTRS_KEY",
    "ZARR_JSON",
    "INDEX_ENTRY_NBYTES",
    "CHECKSUM_NBYTES",
    "EMPTY_ENTRY",
    "DEFAULT_SHARD_BYTES",
    "FieldSpec",
    "ShardInfo",
    "SkippedInput",
    "chunk_key",
    "index_nbytes",
    "records_per_shard_for",
]

#: Version of the layout described in this module. Readers refuse anything newer.
FORMAT_VERSION = 1
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


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one field of a record (the payload or a small per-record field).

    Parameters
    ----------
    shape
        Shape of the field for ONE record (``()`` for a scalar such as ``label``).
    dtype
        numpy dtype string, e.g. ``"uint8"``, ``"int64"``, ``"float32"``.
    """

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if any(s <= 0 for s in self.shape):
            raise SchemaError(f"field shape must be positive in every dimension, found {self.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of one record of this field when stored uncompressed."""
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FieldSpec:
        return cls(shape=tuple(data["shape"]), dtype=data["dtype"])

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
    """What the group metadata records about one payload shard file.

    Attributes
    ----------
    path
        Path of the shard file relative to the dataset root (zarr chunk key of the payload array).
    start, stop
        Global record range ``[start, stop)`` held by the shard.
    nbytes
        Exact size of the file in bytes (records + index + index checksum).
    crc32c
        crc32c of the whole file, so ``verify`` detects any flipped bit, index included.
    """

    path: str
    start: int
    stop: int
    nbytes: int
    crc32c: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardInfo:
        return cls(
            path=str(data["path"]),
            start=int(data["start"]),
            stop=int(data["stop"]),
            nbytes=int(data["nbytes"]),
            crc32c=int(data["crc32c"]),
        )


@dataclass(frozen=True)
class SkippedInput:
    """An input file a converter did not turn into a record, and why."""

    path: str
    reason: str
    cursor: int = field(default=-1, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


def chunk_key(array_name: str, shard_index: int, ndim: int) -> str:
    """zarr v3 ``default`` chunk key (separator ``/``) of shard ``shard_index`` along axis 0."""
    return "/".join([array_name, "c", str(shard_index), *(["0"] * (ndim - 1))])


def index_nbytes(records_per_shard: int) -> int:
    """Bytes of a shard's index including its crc32c."""
    return records_per_shard * INDEX_ENTRY_NBYTES + CHECKSUM_NBYTES


def records_per_shard_for(record_nbytes: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Records per shard so that an uncompressed shard file is about ``shard_bytes`` bytes."""
    if record_nbytes <= 0:
        raise SchemaError(f"record size must be positive, found {record_nbytes} bytes")
    if shard_bytes <= 0:
        raise SchemaError(f"shard size must be positive, found {shard_bytes} bytes")
    return max(1, shard_bytes // (record_nbytes + INDEX_ENTRY_NBYTES))
