"""``verify``: prove every shard is exactly what the metadata says.

Quick mode checks metadata, file presence and sizes, and every index (its crc32c and that it
describes the recorded number of records). Full mode also streams every shard file through crc32c
and compares it with the checksum recorded at write time, so a single flipped bit anywhere, record
or index, is found and reported with the shard and its record range. Small field arrays are decoded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardkit.errors import ChecksumError, CorruptShardError, ShardkitError
from shardkit.formats.dataset import Dataset
from shardkit.formats.index import extend_crc32c
from shardkit.formats.reader import read_plain_array

__all__ = ["VerifyReport", "Problem", "verify"]

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
    """Outcome of :func:`verify`."""

    path: str
    quick: bool
    shards_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def file_crc32c(path: Path, drop_cache: bool = False) -> tuple[int, int]:
    """(crc32c, size) of a whole file, streamed in 8 MiB reads."""
    crc = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while True:
            n = os.readv(fd, [view])
            if n == 0:
                break
            crc = extend_crc32c(crc, view[:n])
            size += n
    finally:
        os.close(fd)
    return crc, size


def verify(
    path: str | os.PathLike[str],
    *,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a dataset; never raises for a damaged shard, reports it instead.

    Raises
    ------
    ShardkitError
        Only when the dataset cannot be opened at all (not a dataset, newer version, ...).
    """
    ds = Dataset(path)
    report = VerifyReport(str(ds.path), quick)
    try:
        for i, info in enumerate(ds.meta.shards):
            shard_path = ds.payload.shard_path(i)
            try:
                idx = ds.payload.index(i)  # existence, size, index crc32c, index bounds
                present = int(idx.present[: info.count].sum())
                extra = int(idx.present[info.count :].sum())
                if present != info.count or extra:
                    raise CorruptShardError(
                        f"index holds {present + extra} records, expected {info.count}"
                    )
                if not quick:
                    crc, size = file_crc32c(shard_path)
                    report.bytes_checked += size
                    if crc != info.crc32c:
                        raise ChecksumError(
                            f"content crc32c {crc:#010x} differs from the recorded {info.crc32c:#010x}"
                        )
            except ShardkitError as exc:
                msg = str(exc)
                prefix = f"{shard_path}: "
                if msg.startswith(prefix):
                    msg = msg[len(prefix) :]
                report.problems.append(Problem(str(shard_path), info.start, info.stop, msg))
            report.shards_checked += 1
            if progress is not None:
                progress(info.nbytes)
        if not quick:
            for name in ds.meta.fields:
                try:
                    read_plain_array(ds.path / name, ds.num_records)
                except ShardkitError as exc:
                    report.problems.append(Problem(str(ds.path / name), 0, 0, str(exc)))
    finally:
        ds.close()
    for p in report.problems:
        logger.warning("verify: %s", p)
    return report
