"""``verify``: prove every file of a dataset is exactly what the metadata says (docs/design.md §3, *Integrity*).

Each failure is a :class:`Problem` naming the file, and what a dataset's format version cannot cover
is listed, so a user knows what "OK" means.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardkit.errors import ChecksumError, CorruptShardError, MissingShardError, ShardkitError, TruncatedShardError
from shardkit.formats.checksums import fd_crc32c
from shardkit.formats.dataset import Dataset
from shardkit.formats.fields import read_field_rows
from shardkit.formats.index import extend_crc32c
from shardkit.formats.metadata import DatasetMeta
from shardkit.formats.spec import FORMAT_MINOR, FORMAT_VERSION, ShardInfo, format_string, index_nbytes
from shardkit.formats.versions import unfinished
from shardkit.stores import ByteRange, Location, Store
from shardkit.stores.local import open_regular

__all__ = ["VerifyReport", "Problem", "verify", "limitations", "shard_crc32c", "object_crc32c"]

logger = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    """One failed check: which file, which records, what is wrong."""

    path: str
    start: int
    stop: int
    message: str

    def __str__(self) -> str:
        where = f" (records {self.start}-{self.stop - 1})" if self.stop > self.start else ""
        return f"{self.path}{where}: {self.message}"


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`: the dataset's ``format`` (``"1.1"``); payload shards, other files and
    bytes checked; and, one sentence each, every failed check (``problems``), the checks its format
    cannot have (``limitations``), and interrupted conversions or appends and how to finish them
    (``unfinished``, the likely cause of any problem)."""

    path: str
    quick: bool
    format: str = ""
    shards_checked: int = 0
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    limitations: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def limitations(meta: DatasetMeta) -> list[str]:
    """What ``verify`` cannot check in a dataset written by ``meta.format``."""
    out: list[str] = []
    if meta.format_minor == 0:
        out += [
            "written by format 1.0: shard indexes are not bound to the metadata (an index rewritten with a "
            "valid crc32c is found only where it breaks the record layout)",
            "written by format 1.0: field chunks and array documents carry no checksums (a field chunk is "
            "only checked to exist and to decode into the declared shape)",
            "written by format 1.0: the dataset metadata (zarr.json) carries no checksum of itself",
        ]
    if meta.format_minor > FORMAT_MINOR:
        out.append(
            f"written by format {meta.format}, newer than this shardkit's "
            f"{format_string(FORMAT_VERSION, FORMAT_MINOR)}: checks added since are not run"
        )
    return out


def shard_crc32c(path: Path, data_nbytes: int) -> tuple[int, int, int]:
    """``(data crc32c, whole-file crc32c, size)`` of a shard whose records end at ``data_nbytes``."""
    fd = open_regular(path, "payload shard")
    try:
        return fd_crc32c(fd, data_nbytes, _CHUNK)
    finally:
        os.close(fd)


def verify(
    path: Location,
    *,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a dataset; never raises for a damaged shard or field, reports it instead.

    Opening checks the metadata and array documents; ``quick`` then checks every shard's size and index
    (checksums, bounds, layout, record count) and every file's presence and size; the full check also
    streams every byte against the recorded checksums and decodes compressed records and every field
    chunk, as the readers do. ``progress`` gets each shard's bytes. Raises ShardkitError (naming the
    file) only when the dataset cannot be opened at all.
    """
    ds = Dataset(path)
    report = VerifyReport(str(ds.path), quick, format=ds.meta.format, limitations=limitations(ds.meta), unfinished=unfinished(ds.store))
    try:
        for i, info in enumerate(ds.meta.shards):
            _check_shard(ds, i, info, quick, report)
            report.shards_checked += 1
            if progress is not None:
                progress(info.nbytes)
        damaged = _check_files(ds, quick, report)
        if not quick:
            _check_fields(ds, damaged, report)
    finally:
        ds.close()
    for p in report.problems:
        logger.info("verify: %s", p)
    return report


def _check_shard(ds: Dataset, i: int, info: ShardInfo, quick: bool, report: VerifyReport) -> None:
    where = ds.payload.shard_location(i)
    try:
        if not ds.store.is_local:
            size = ds.store.head(info.path).size
            if size != info.nbytes:
                raise TruncatedShardError(f"expected {info.nbytes} bytes as recorded in the metadata, found {size}")
        idx = ds.payload.stored_index(i)  # existence, size, index crc32c (own and recorded), bounds, layout
        present = int(idx.present[: info.count].sum())
        extra = int(idx.present[info.count :].sum())
        if present != info.count or extra:
            raise CorruptShardError(f"index holds {present + extra} records, expected {info.count}")
        if not quick:
            data_nbytes = info.nbytes - index_nbytes(ds.meta.records_per_shard)
            if ds.store.is_local:
                data_crc, crc, size = shard_crc32c(ds.payload.shard_path(i), data_nbytes)
            else:
                data_crc, crc, size = object_crc32c(ds.store, info.path, info.nbytes, data_nbytes)
            report.bytes_checked += size
            if info.data_crc32c is not None and data_crc != info.data_crc32c:
                raise ChecksumError(f"records crc32c {data_crc:#010x} differs from the {info.data_crc32c:#010x} recorded in the metadata")
            if crc != info.crc32c:
                raise ChecksumError(f"content crc32c {crc:#010x} differs from the recorded {info.crc32c:#010x}")
            if ds.payload.codec is not None:
                _decode_records(ds, info)
    except ShardkitError as exc:
        report.problems.append(Problem(where, info.start, info.stop, _strip(str(exc), where)))


def _decode_records(ds: Dataset, info: ShardInfo) -> None:
    """Decode every record of a compressed shard through the readers' own path, in batches of at most
    :data:`_CHUNK` bytes: a record that does not decode to exactly its size fails here as in the sampler."""
    payload = ds.payload
    step = max(1, _CHUNK // payload.record_nbytes)
    out = payload.empty(min(step, info.count))
    for a in range(info.start, info.stop, step):
        b = min(a + step, info.stop)
        payload.read(np.arange(a, b, dtype=np.int64), out)


def object_crc32c(store: Store, key: str, size: int, data_nbytes: int) -> tuple[int, int, int]:
    """:func:`shard_crc32c` of an object in a store: ``size`` bytes fetched as concurrent ranges of
    ``request_bytes``, folded into the checksums in order (at most ``concurrency`` ranges held)."""
    step = store.options.request_bytes
    window = max(1, store.options.concurrency)
    data_crc = crc = 0
    done = 0
    starts = list(range(0, size, step))
    for w in range(0, len(starts), window):
        asks = [ByteRange(key, a, min(a + step, size)) for a in starts[w : w + window]]
        got: dict[int, memoryview] = {}
        for item in store.fetch(asks):
            if item.object_size != size:
                raise TruncatedShardError(f"expected {size} bytes as recorded in the metadata, found {item.object_size}")
            got[item.index] = item.data
        for j in range(len(asks)):
            chunk = got.pop(j)
            if done < data_nbytes:
                data_crc = extend_crc32c(data_crc, chunk[: data_nbytes - done])
            crc = extend_crc32c(crc, chunk)
            done += chunk.nbytes
    return data_crc, crc, done


def _check_files(ds: Dataset, quick: bool, report: VerifyReport) -> set[str]:
    """Check every file with a recorded digest; returns the names of fields with a damaged file."""
    damaged: set[str] = set()
    table = {} if ds.provenance is None else dict(ds.provenance.files)
    for rel, digest in {**ds.meta.files, **table}.items():
        where = ds.store.describe(rel)
        try:
            try:
                size = ds.store.head(rel).size
            except FileNotFoundError:
                raise MissingShardError("listed in the dataset metadata but missing") from None
            if size != digest.nbytes:
                raise TruncatedShardError(f"expected {digest.nbytes} bytes as recorded in the metadata, found {size}")
            if not quick:
                digest.check(where, ds.store.get(rel, max_nbytes=digest.nbytes))
                report.bytes_checked += size
        except ShardkitError as exc:
            damaged.add(rel.split("/", 1)[0])
            report.problems.append(Problem(where, 0, 0, _strip(str(exc), where)))
        report.files_checked += 1
    return damaged


def _check_fields(ds: Dataset, damaged: set[str], report: VerifyReport) -> None:
    """Decode every field not already reported damaged (format 1.0: the only check of its chunks)."""
    m = ds.meta
    for name, spec in m.fields.items():
        if name in damaged:
            continue
        try:
            read_field_rows(ds.store, name, spec, m.num_records, m.field_chunk_records, m.files)
        except ShardkitError as exc:
            report.problems.append(Problem(ds.store.describe(name), 0, 0, str(exc)))


def _strip(message: str, path: Path | str) -> str:
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
