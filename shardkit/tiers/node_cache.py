"""A node's cache on its local disk: the part of the node partition beyond the RAM static cache, one
verified dataset per partition, written once per node and kept between runs (docs/design.md §10).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import OutOfSpaceError, SamplerError, ShardkitError
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, PayloadArray, ReadStats
from shardkit.formats.reader import Destination
from shardkit.formats.spec import records_per_shard_for
from shardkit.formats.verify import verify
from shardkit.privdir import DIR_MODE, FILE_MODE, PrivateDir
from shardkit.stopping import POLL_SECONDS, Stopped
from shardkit.stores.atomic import is_out_of_space, raise_out_of_space
from shardkit.tiers.static_cache import SortedKeys

__all__ = ["NodeDiskCache", "DIR_PREFIX", "node_cache_dir", "entry_name"]

logger = logging.getLogger(__name__)

#: The user's private directory of node caches under ``node_cache_dir``.
DIR_PREFIX = "shardkit-node-cache-"
#: Bytes beyond the payload an entry needs (zarr documents, shard indexes, the source_key field).
_OVERHEAD = 1 << 20


def _make_private(path: Path) -> None:
    """``DIR_MODE`` / ``FILE_MODE`` for ``path`` and everything under it (symlinks are skipped)."""
    os.chmod(path, DIR_MODE)
    for root, dirs, files in os.walk(path):
        for name, mode in [(d, DIR_MODE) for d in dirs] + [(f, FILE_MODE) for f in files]:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, mode)


def _write_entry(disk: Dataset, keys: np.ndarray, dest: Path, stop: threading.Event, chunk_bytes: int = 64 << 20) -> int:
    """Copy records ``keys`` of ``disk`` into a new dataset at ``dest`` in ascending key order, with
    their ``source_key`` (a whole dataset, verifiable when reused), through one buffer of about
    ``chunk_bytes``; returns the payload bytes written. A failure or ``stop`` deletes the partial entry.
    """
    sorted_keys = np.unique(np.asarray(keys, dtype=np.int64))
    rec = disk.meta.record
    per_chunk = max(1, chunk_bytes // max(1, disk.record_nbytes))
    buf = disk.payload.empty(min(per_chunk, max(1, sorted_keys.size)))
    written = 0
    try:
        with DatasetWriter(
            dest, kind=disk.meta.kind, payload=disk.payload_name, record=FieldSpec(rec.shape, rec.dtype),
            fields={"source_key": FieldSpec((), "int64")},
            records_per_shard=max(1, min(sorted_keys.size, records_per_shard_for(disk.record_nbytes))),
            compression=None, durable=False,  # the caller syncs the whole tree before naming it
        ) as writer:  # fmt: skip
            for a in range(0, sorted_keys.size, per_chunk):
                if stop.is_set():
                    raise Stopped()
                chunk = sorted_keys[a : a + per_chunk]
                out = disk.payload.read(chunk, out=buf)[: chunk.size]
                writer.write({disk.payload_name: out, "source_key": chunk})
                written += out.nbytes
            writer.close()  # inside the block, so a failing close aborts the writer too
    except BaseException as exc:
        shutil.rmtree(dest, ignore_errors=True)
        if is_out_of_space(exc):
            raise_out_of_space(dest, "writing a node cache entry")
        raise
    return written


def node_cache_dir(parent: str | os.PathLike[str] | None) -> Path:
    """The user's private directory of node caches under ``parent`` (default: the temp dir)."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    return base / f"{DIR_PREFIX}{os.geteuid()}"


def entry_name(fingerprint: str, seed: int, nodes: int, node: int, lo: int, hi: int) -> str:
    """The entry holding depths ``[lo, hi)`` of node ``node``'s home list of the partition
    ``(seed, nodes)`` of the dataset with identity ``fingerprint``."""
    text = f"shardkit node cache v1|{fingerprint}|{seed}|{nodes}|{node}|{lo}|{hi}"
    return "entry-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(path: Path) -> None:
    """fsync every file and directory under ``path``, deepest first."""
    for root, _dirs, names in os.walk(path, topdown=False):
        for name in names:
            _fsync(os.path.join(root, name))
        _fsync(root)


class NodeDiskCache:
    """This node's records on its local disk (docs/design.md §10).

    Parameters
    ----------
    keys
        The keys of the disk part (any order).
    dataset, dataset_options
        The dataset the entry is written from, and the keyword arguments of its :class:`Dataset`.
    directory, name
        The user's node-cache directory (:func:`node_cache_dir`) and the entry (:func:`entry_name`).
    stats
        Where reads from the entry are counted.
    """

    def __init__(
        self,
        keys: np.ndarray,
        *,
        dataset: Path | str,
        directory: Path,
        name: str,
        stats: ReadStats,
        dataset_options: dict[str, Any] | None = None,
    ) -> None:
        self.keys = np.unique(np.asarray(keys, dtype=np.int64))
        self._rows = SortedKeys(self.keys)
        self.dataset = dataset
        self._options = dict(dataset_options or {})
        self.directory = Path(directory)
        self.entry = self.directory / name
        self._stats = stats
        self._disk: Dataset | None = None
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return int(self.keys.size)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(hit, row)``: which of ``keys`` the entry holds, and each one's record in it."""
        return self._rows.lookup(keys)

    def reader(
        self, payload: PayloadArray, stop: threading.Event
    ) -> Callable[[np.ndarray, Destination], None]:
        """``read(keys, destination)`` as :meth:`~shardkit.formats.PayloadArray.read_into` of the
        dataset, except that the entry's records come from the entry (written on first use)."""

        def read(keys: np.ndarray, dest: Destination) -> None:
            keys = np.asarray(keys, dtype=np.int64)
            local = self.open(payload, stop)
            hit, row = self.lookup(keys)
            if hit.any():
                local.payload.read_into(row[hit], Destination(dest.buffers, dest.which[hit], dest.rows[hit]))
            if not hit.all():
                miss = ~hit
                payload.read_into(keys[miss], Destination(dest.buffers, dest.which[miss], dest.rows[miss]))

        return read

    def open(self, payload: PayloadArray, stop: threading.Event) -> Dataset:
        """The entry's dataset, written first (once per node) if no valid one exists."""
        with self._lock:
            if self._disk is None:
                self._disk = self._open_or_build(payload, stop)
            return self._disk

    def close(self) -> None:
        """Close the entry (it stays on disk for later runs)."""
        with self._lock:
            if self._disk is not None:
                self._disk.close()
                self._disk = None

    # ------------------------------------------------------------------ the entry
    def _open_or_build(self, payload: PayloadArray, stop: threading.Event) -> Dataset:
        """The disk part's dataset, written under the directory lock unless a valid one exists."""
        if not self.directory.parent.is_dir():
            raise SamplerError(f"node_cache_dir: expected an existing directory, found {str(self.directory.parent)!r}")
        with PrivateDir.create(self.directory, what="the node cache directory",
                               advice="Remove it, or choose another node_cache_dir") as run:  # fmt: skip
            found = self._valid_entry(payload)
            if found is not None:
                return found
            lock = self._wait_for_lock(run, stop)
            try:
                found = self._valid_entry(payload)  # another process of this node wrote it meanwhile
                if found is not None:
                    return found
                self._build(payload, stop)
            finally:
                os.close(lock)
            built = self._valid_entry(payload)
            if built is None:
                raise SamplerError(f"{self.entry}: the node cache just written does not match its keys")
            return built

    def _wait_for_lock(self, run: PrivateDir, stop: threading.Event) -> int:
        fd = run.lock()
        if fd is None and not stop.is_set():
            logger.info("%s: another process of this node is writing the node cache; waiting", self.entry)
        while fd is None:
            if stop.wait(POLL_SECONDS):
                raise Stopped()
            fd = run.lock()
        return fd

    def _build(self, payload: PayloadArray, stop: threading.Event) -> None:
        """Write the entry under a temporary name, then rename it into place (with the directory
        lock held, so leftovers of writers that died are removed first)."""
        for stale in self.directory.glob(".entry-*.building-*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        if self.entry.is_symlink() or self.entry.is_file():
            self.entry.unlink()
        elif self.entry.exists():
            shutil.rmtree(self.entry)
        need = self.keys.size * payload.record_nbytes + _OVERHEAD
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OutOfSpaceError(
                f"{self.directory}: the node cache needs {need} bytes ({self.keys.size} records), the "
                f"filesystem has {free} free; lower node_cache or choose another node_cache_dir"
            )
        tmp = self.directory / f".{self.entry.name}.building-{os.getpid()}-{secrets.token_hex(4)}"
        with Dataset(self.dataset, stats=payload.stats, **self._options) as source:
            _write_entry(source, self.keys, tmp, stop)
        _make_private(tmp)
        _sync_tree(tmp)  # unlike a reservoir, the entry outlives the run: only whole entries get a name
        os.rename(tmp, self.entry)
        _fsync(self.directory)
        logger.info("%s: wrote %d pinned records of this node", self.entry, self.keys.size)

    def _valid_entry(self, payload: PayloadArray) -> Dataset | None:
        """The entry opened, if it holds exactly ``keys`` in the dataset's record format."""
        if not self.entry.is_dir() or self.entry.is_symlink():
            return None
        try:
            report = verify(self.entry, quick=True)  # every file there, of its size, indexes intact
            if not report.ok:
                raise SamplerError("; ".join(str(p) for p in report.problems[:3]))
            ds = Dataset(self.entry, stats=self._stats, gap_bytes=payload.gap_bytes)
        except (ShardkitError, OSError) as exc:
            logger.warning("%s: unusable node cache entry (%s); writing it again", self.entry, exc)
            return None
        source = ds.fields.get("source_key")
        if (
            ds.num_records != self.keys.size
            or ds.payload.record != payload.record
            or source is None
            or not np.array_equal(source, self.keys)
        ):
            logger.warning("%s: node cache entry does not hold the expected records; writing it again", self.entry)
            ds.close()
            return None
        return ds
