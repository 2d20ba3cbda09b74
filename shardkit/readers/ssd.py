"""The SSD tier: a run's private directory of reservoirs, and writing one reservoir.

Each run gets ``<ssd_dir>/shardkit-ssd-<pid>-<random>/`` holding a ``lock`` file locked with
``fcntl.flock(LOCK_EX)`` for the run's lifetime. The kernel drops a flock when its holder dies
(even by SIGKILL), so at start-up a sibling ``shardkit-ssd-*`` directory whose lock can be taken
without blocking belongs to a dead run and is deleted, while one whose lock is held belongs to a
live run (another process, or another sampler in this one) and is left alone. The directory is
created under a hidden name and renamed only once its lock is held, so a scanner never sees a live
directory without its lock.

A reservoir is a shardkit dataset in the same format (payload uncompressed, plus an int64
``source_key`` field): records in ascending key order, i.e. read from the disk tier with ascending
offsets, written sequentially.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
from pathlib import Path

import numpy as np

from shardkit.errors import OutOfSpaceError, SamplerError
from shardkit.formats import Dataset, DatasetWriter, FieldSpec
from shardkit.formats.spec import records_per_shard_for

__all__ = ["SsdSpace", "PREFIX", "remove_stale", "write_reservoir", "READ_CHUNK_BYTES"]

logger = logging.getLogger(__name__)

#: Name prefix of a run's private directory.
PREFIX = "shardkit-ssd-"
LOCK_NAME = "lock"
#: Disk -> SSD copies go through a reusable buffer of about this size, so memory stays bounded
#: whatever the reservoir size; 64 MiB is ~30 ms of sequential reading, long enough to amortise a
#: request, small next to the RAM tier.
READ_CHUNK_BYTES = 64 << 20


def _try_lock(path: Path) -> int | None:
    """Open and exclusively lock ``path`` without blocking; the fd, or None if someone holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale(ssd_dir: Path) -> list[Path]:
    """Delete ``shardkit-ssd-*`` directories under ``ssd_dir`` whose owner is dead; return them."""
    removed: list[Path] = []
    try:
        candidates = sorted(p for p in Path(ssd_dir).iterdir() if p.name.startswith(PREFIX) and p.is_dir())
    except FileNotFoundError:
        return removed
    for d in candidates:
        fd = _try_lock(d / LOCK_NAME)
        if fd is None:
            continue  # a live run holds it (or it vanished meanwhile)
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            logger.info("%s: removed the SSD directory of a run that no longer exists", d)
        finally:
            os.close(fd)
    return removed


class SsdSpace:
    """A run's private, locked SSD directory (see module docstring)."""

    def __init__(self, ssd_dir: str | os.PathLike[str]) -> None:
        self.parent = Path(ssd_dir)
        if not self.parent.is_dir():
            from shardkit.errors import ConfigError

            raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.parent)!r}")
        remove_stale(self.parent)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        building = self.parent / f".{name}.creating"
        building.mkdir()
        fd = _try_lock(building / LOCK_NAME)
        if fd is None:
            shutil.rmtree(building, ignore_errors=True)
            raise SamplerError(f"{building}: cannot lock a fresh SSD directory")
        self._lock_fd: int | None = fd
        self.path = self.parent / name
        os.rename(building, self.path)
        self._closed = threading.Lock()

    def reservoir_path(self, j: int) -> Path:
        return self.path / f"reservoir-{j:08d}"

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Delete everything and release the lock (idempotent)."""
        with self._closed:
            if self._lock_fd is None:
                return
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def write_reservoir(
    disk: Dataset,
    keys: np.ndarray,
    dest: Path,
    stop: threading.Event,
    chunk_bytes: int = READ_CHUNK_BYTES,
) -> int:
    """Copy records ``keys`` from ``disk`` into a new dataset at ``dest`` in ascending key order.

    Reads in chunks of about ``chunk_bytes`` (ascending offsets inside each shard, one pass) into one
    reused buffer, writes each chunk sequentially. Returns the number of payload bytes written. On
    any failure (including ``OutOfSpaceError``) or when ``stop`` is set, the partial reservoir is
    deleted, so no half-written reservoir is ever read.
    """
    sorted_keys = np.unique(np.asarray(keys, dtype=np.int64))
    rec = disk.meta.record
    per_chunk = max(1, chunk_bytes // max(1, disk.record_nbytes))
    buf = disk.payload.empty(min(per_chunk, max(1, sorted_keys.size)))
    written = 0
    try:
        writer = DatasetWriter(
            dest,
            kind=disk.meta.kind,
            payload=disk.payload_name,
            record=FieldSpec(rec.shape, rec.dtype),
            fields={"source_key": FieldSpec((), "int64")},
            # Shards no larger than the reservoir, so a small reservoir gets a small index.
            records_per_shard=max(1, min(sorted_keys.size, records_per_shard_for(disk.record_nbytes))),
            compression=None,
            # Scratch data: worthless after a crash, so nothing waits for the disk (no fsync);
            # renames still make every file appear whole or not at all.
            durable=False,
        )
        try:
            for a in range(0, sorted_keys.size, per_chunk):
                if stop.is_set():
                    writer.abort()
                    raise _Stopped()
                chunk = sorted_keys[a : a + per_chunk]
                out = disk.payload.read(chunk, out=buf)[: chunk.size]
                writer.write({disk.payload_name: out, "source_key": chunk})
                written += out.nbytes
            writer.close()
        except BaseException:
            writer.abort()
            raise
    except BaseException as exc:
        shutil.rmtree(dest, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, OutOfSpaceError) and exc.errno in (
            errno.ENOSPC,
            errno.EDQUOT,
        ):
            raise OutOfSpaceError(f"{dest}: no space left on device while writing an SSD reservoir") from None
        raise
    return written


class _Stopped(Exception):
    """Internal: the run was asked to stop while a reservoir was being written."""
