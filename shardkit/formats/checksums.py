"""Checksums recorded in the metadata for every file a reader trusts (format 1.1), and reading files
checked against them. What each covers and why: docs/design.md §3 (*Integrity*).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.errors import ChecksumError, MissingShardError, NotADatasetError, ObjectTooLargeError, TruncatedShardError
from shardkit.formats import jsonvalues as jv
from shardkit.formats.index import crc32c_of, extend_crc32c
from shardkit.formats.spec import MAX_CRC32C
from shardkit.stores import ByteRange, Store
from shardkit.stores.local import open_regular

__all__ = ["FileDigest", "ATTRIBUTES_CRC_KEY", "attributes_crc32c", "read_verified", "read_object", "read_objects", "fd_crc32c",
           "extend_fd_crc32c"]

#: Key of the self-checksum inside the ``shardkit`` attributes.
ATTRIBUTES_CRC_KEY = "attributes_crc32c"


@dataclass(frozen=True)
class FileDigest:
    """Size and crc32c of one file's bytes, as recorded in the metadata."""

    nbytes: int
    crc32c: int

    @classmethod
    def of(cls, data: bytes) -> FileDigest:
        return cls(len(data), crc32c_of(data))

    def to_json(self) -> dict[str, int]:
        return {"nbytes": self.nbytes, "crc32c": self.crc32c}

    @classmethod
    def from_json(cls, data: Any, *, where: str, what: str) -> FileDigest:
        doc = jv.mapping(data, what, where)
        return cls(
            nbytes=jv.integer(jv.member(doc, "nbytes", where), f"{what}.nbytes", where),
            crc32c=jv.integer(jv.member(doc, "crc32c", where), f"{what}.crc32c", where, hi=MAX_CRC32C),
        )

    def check(self, path: Path | str, data: bytes) -> None:
        """Raise if ``data`` (the bytes read from ``path``) is not what was recorded."""
        if len(data) != self.nbytes:
            raise TruncatedShardError(f"{path}: expected {self.nbytes} bytes as recorded in the metadata, found {len(data)}")
        crc = crc32c_of(data)
        if crc != self.crc32c:
            raise ChecksumError(f"{path}: crc32c {crc:#010x} differs from the {self.crc32c:#010x} recorded in the metadata")


def read_verified(path: Path, digest: FileDigest | None, *, what: str = "file", max_nbytes: int | None = None) -> bytes:
    """The bytes of ``path``, checked against ``digest`` when there is one; the size is checked against
    it (and ``max_nbytes``) before reading, and anything but a regular file is refused by name."""
    try:
        fd = open_regular(path, what)  # a named pipe or device is refused, never waited on
    except FileNotFoundError:
        raise MissingShardError(f"{path}: {what} listed in the dataset metadata is missing") from None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        if digest is not None and size != digest.nbytes:
            raise TruncatedShardError(f"{path}: expected {digest.nbytes} bytes as recorded in the metadata, found {size}")
        if max_nbytes is not None and size > max_nbytes:
            raise NotADatasetError(f"{path}: {what} of {size} bytes, more than the {max_nbytes} bytes allowed")
        data = fh.read(size + 1)  # one more byte: a file that grew since is caught below, not read whole
    if digest is None and len(data) != size:
        raise NotADatasetError(f"{path}: {what} changed size while it was read ({size} bytes, then {len(data)})")
    if digest is not None:
        digest.check(path, data)
    return data


def read_object(
    store: Store, key: str, digest: FileDigest | None = None, *, what: str = "file", max_nbytes: int | None = None
) -> bytes:
    """The bytes of object ``key`` of ``store``, checked like :func:`read_verified` (remotely: one GET
    whose announced size is bounded before the body is read)."""
    if store.is_local:
        return read_verified(store.local_path(key), digest, what=what, max_nbytes=max_nbytes)
    where = store.describe(key)
    limit = max_nbytes if digest is None else digest.nbytes
    try:
        data = store.get(key, max_nbytes=limit)
    except FileNotFoundError:
        raise MissingShardError(f"{where}: {what} listed in the dataset metadata is missing") from None
    except ObjectTooLargeError:
        if digest is not None:
            raise TruncatedShardError(f"{where}: larger than the {digest.nbytes} bytes recorded in the metadata") from None
        raise NotADatasetError(f"{where}: {what} larger than the {max_nbytes} bytes allowed") from None
    if digest is not None:
        digest.check(where, data)
    return data


def read_objects(
    store: Store, keys: list[str], files: Mapping[str, FileDigest], *, what: str, max_nbytes: int
) -> list[bytes]:
    """Several objects of a remote store, each checked like :func:`read_object`: those whose size is
    recorded fetched concurrently as whole-object ranges, the others one GET each."""
    known = [k for k in keys if k in files and files[k].nbytes > 0]
    got: dict[str, bytes] = {}
    ranges = [ByteRange(k, 0, files[k].nbytes) for k in known]
    try:
        for item in store.fetch(ranges):
            key = known[item.index]
            digest = files[key]
            if item.object_size != digest.nbytes:
                raise TruncatedShardError(
                    f"{store.describe(key)}: expected {digest.nbytes} bytes as recorded in the metadata, found {item.object_size}"
                )
            data = bytes(item.data)
            digest.check(store.describe(key), data)
            got[key] = data
    except FileNotFoundError as exc:
        raise MissingShardError(f"{exc}: {what} listed in the dataset metadata is missing") from None
    return [got[k] if k in got else read_object(store, k, files.get(k), what=what, max_nbytes=max_nbytes) for k in keys]


def fd_crc32c(fd: int, data_nbytes: int, chunk: int = 8 << 20) -> tuple[int, int, int]:
    """``(crc32c of the first data_nbytes bytes, crc32c of the whole file, size)`` of an open file,
    streamed once with ``pread`` (a shard's records checksum and its whole-file checksum)."""
    return extend_fd_crc32c(fd, data_nbytes, 0, None, chunk=chunk)


def extend_fd_crc32c(fd: int, data_nbytes: int, start: int, end: int | None, data_crc: int = 0, crc: int = 0,
                     chunk: int = 8 << 20) -> tuple[int, int, int]:
    """:func:`fd_crc32c` of bytes ``[start, end)`` of an open file (``end`` None: to its end), extending
    ``data_crc`` (below ``data_nbytes``) and ``crc``: ``(data_crc, crc, where the read stopped)``,
    short of ``end`` when the file is."""
    pos = start
    view = memoryview(bytearray(chunk if end is None else max(1, min(chunk, end - start))))
    while end is None or pos < end:
        n = os.preadv(fd, [view if end is None else view[: end - pos]], pos)
        if n == 0:
            break
        part = view[:n]
        if pos < data_nbytes:
            data_crc = extend_crc32c(data_crc, part[: data_nbytes - pos])
        crc = extend_crc32c(crc, part)
        pos += n
    return data_crc, crc, pos


def attributes_crc32c(attrs: dict[str, Any]) -> int:
    """crc32c of the canonical JSON of the ``shardkit`` attributes, without their own checksum."""
    body = {k: v for k, v in attrs.items() if k != ATTRIBUTES_CRC_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return crc32c_of(canonical.encode("ascii"))
