"""A payload shard's index: ``S x [offset u64, nbytes u64]`` little-endian, then its crc32c.

This is zarr v3's ``sharding_indexed`` index with ``index_codecs = [bytes(little), crc32c]``. An
inner chunk that was never written has offset = nbytes = 2**64 - 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import google_crc32c
import numpy as np

from shardkit.errors import CorruptIndexError
from shardkit.formats.spec import CHECKSUM_NBYTES, EMPTY_ENTRY, index_nbytes

__all__ = ["ShardIndex", "crc32c_of", "extend_crc32c", "combine_crc32c"]

_INDEX_DTYPE = np.dtype("<u8")


def crc32c_of(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """crc32c (Castagnoli) of a buffer, hardware-accelerated by google-crc32c."""
    return int(google_crc32c.value(_readonly(data)))


def extend_crc32c(crc: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Continue a running crc32c with more bytes."""
    return int(google_crc32c.extend(crc, _readonly(data)))


def combine_crc32c(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``a + b`` from ``crc1`` (of ``a``), ``crc2`` (of ``b``) and ``len(b)``, without the
    bytes: parts checksummed while they land (in any order) give the whole copy's checksum."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_apply(_zeros_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


#: The reflected Castagnoli polynomial.
_CRC32C_POLY = 0x82F63B78


def _gf2_apply(mat: tuple[int, ...], vec: int) -> int:
    out = 0
    for row in mat:
        if vec & 1:
            out ^= row
        vec >>= 1
        if not vec:
            break
    return out


def _gf2_square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_apply(mat, row) for row in mat)


@functools.cache
def _zeros_operator(k: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a crc32c register over ``2**k`` zero bytes (at most 64 of
    them, each built once by squaring the one before)."""
    if k == 0:
        op = (_CRC32C_POLY, *(1 << n for n in range(31)))  # one zero bit
        for _ in range(3):
            op = _gf2_square(op)  # 2, 4, 8 zero bits
        return op
    return _gf2_square(_zeros_operator(k - 1))


def _readonly(data: bytes | bytearray | memoryview | np.ndarray) -> bytes | np.ndarray:
    # google-crc32c takes bytes and numpy arrays, not memoryviews: the rest as a zero-copy uint8 array.
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


@dataclass(frozen=True)
class ShardIndex:
    """Offsets and sizes of every inner chunk (record) of one shard: ``uint64`` arrays of length S,
    empty entries holding 2**64 - 1."""

    offsets: np.ndarray
    nbytes: np.ndarray

    @property
    def capacity(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def present(self) -> np.ndarray:
        """Boolean mask of entries that point at stored bytes."""
        empty: np.ndarray = (self.offsets == EMPTY_ENTRY) & (self.nbytes == EMPTY_ENTRY)
        return ~empty

    def encode(self) -> bytes:
        raw = np.stack([self.offsets, self.nbytes], axis=1).astype(_INDEX_DTYPE).tobytes()
        return raw + crc32c_of(raw).to_bytes(4, "little")

    @classmethod
    def dense(cls, count: int, capacity: int, record_nbytes: int) -> ShardIndex:
        """Index of an uncompressed shard: record i at ``i * record_nbytes``; slots past ``count`` empty."""
        offsets = np.full(capacity, EMPTY_ENTRY, dtype=np.uint64)
        nbytes = np.full(capacity, EMPTY_ENTRY, dtype=np.uint64)
        offsets[:count] = np.arange(count, dtype=np.uint64) * np.uint64(record_nbytes)
        nbytes[:count] = record_nbytes
        return cls(offsets, nbytes)

    @classmethod
    def decode(
        cls, raw: bytes | memoryview, capacity: int, *, path: str, data_nbytes: int, recorded_crc32c: int | None = None
    ) -> ShardIndex:
        """Parse the index bytes ``raw`` (crc32c included) read from ``path``, whose records take
        ``data_nbytes``; CorruptIndexError for a wrong size, a crc32c that differs from its trailer or
        from ``recorded_crc32c`` (the metadata's, which binds the index to the dataset), an entry past
        the records, or two overlapping entries."""
        expected = index_nbytes(capacity)
        if len(raw) != expected:
            raise CorruptIndexError(f"{path}: expected a {expected}-byte shard index for {capacity} records, found {len(raw)} bytes")
        body = memoryview(raw)[: expected - CHECKSUM_NBYTES]
        stored = int(np.frombuffer(raw, dtype="<u4", offset=expected - CHECKSUM_NBYTES)[0])
        computed = crc32c_of(body)
        if stored != computed:
            raise CorruptIndexError(f"{path}: shard index crc32c mismatch (stored {stored:#010x}, computed {computed:#010x})")
        if recorded_crc32c is not None and computed != recorded_crc32c:
            raise CorruptIndexError(
                f"{path}: shard index crc32c {computed:#010x} differs from the {recorded_crc32c:#010x} recorded "
                "in the dataset metadata (the index was rewritten)"
            )
        table = np.frombuffer(body, dtype=_INDEX_DTYPE).reshape(capacity, 2)
        index = cls(table[:, 0].copy(), table[:, 1].copy())
        index._check_extents(path, data_nbytes)
        return index

    def _check_extents(self, path: str, data_nbytes: int) -> None:
        """Every present entry inside the data bytes, and no two entries overlapping."""
        present = np.flatnonzero(self.present)
        if present.size == 0:
            return
        offs, sizes = self.offsets[present], self.nbytes[present]
        # Compare without forming offset + nbytes, which may wrap around in uint64.
        limit = np.uint64(data_nbytes)
        bad = (offs > limit) | (sizes > limit - np.minimum(offs, limit))
        if bad.any():
            k = int(np.argmax(bad))
            raise CorruptIndexError(
                f"{path}: index entry {int(present[k])} (offset {int(offs[k])}, {int(sizes[k])} bytes) ends past "
                f"the {data_nbytes} data bytes of the file"
            )
        if not bool(np.all(offs[1:] >= offs[:-1])):  # writers store records in order: sort only if not
            order = np.argsort(offs, kind="stable")
            offs, sizes, present = offs[order], sizes[order], present[order]
        overlap = (offs[:-1] + sizes[:-1]) > offs[1:]
        if overlap.any():
            k = int(np.argmax(overlap))
            a, b = int(present[k]), int(present[k + 1])
            raise CorruptIndexError(f"{path}: index entries {a} and {b} overlap (records would be read from the same bytes)")

    def check_dense(self, path: str, count: int, record_nbytes: int) -> None:
        """Refuse an uncompressed shard whose present records are not at ``j * record_nbytes``: the
        layout every writer produces and ``memmap`` relies on, and the only check of an index
        rewritten with a valid crc32c in a format 1.0 dataset."""
        live = self.present[:count]
        expected = np.arange(count, dtype=np.uint64) * np.uint64(record_nbytes)
        wrong = live & ((self.offsets[:count] != expected) | (self.nbytes[:count] != np.uint64(record_nbytes)))
        if wrong.any():
            j = int(np.argmax(wrong))
            raise CorruptIndexError(
                f"{path}: index entry {j} says offset {int(self.offsets[j])}, {int(self.nbytes[j])} bytes; the "
                f"fixed-size layout puts record {j} at offset {int(expected[j])}, {record_nbytes} bytes"
            )
