"""A node's cache: its part of the node partition, pinned in RAM and on the node's local disk.

With ``locality`` (:mod:`shardkit.readers.locality`) node ``m`` pins the keys of its home list up
to depth ``c = static_cache + node_cache`` records: depths ``[0, static_cache)`` in RAM (the static
cache, :class:`~shardkit.readers.static_cache.StaticCache`), depths ``[static_cache, c)`` on its
local disk. Both parts are uniformly random subsets of the dataset, disjoint from every other
node's. :class:`NodeCache` serves a block's keys from whichever part holds them and reads only the
rest from storage, so after the caches are filled every storage read is a miss of the assignment.

The disk part
-------------
``<node_cache_dir>/shardkit-node-cache-<uid>/`` is the user's private directory (mode ``0700``,
owner checked, never through a symlink: :class:`~shardkit.readers.shared.rundir.RunDir`). Each
disk part is one entry in it: a shardkit dataset in the SSD tier's format
(:func:`~shardkit.readers.ssd.write_reservoir`: the pinned records in ascending key order and their
``source_key``), named by a digest of everything that decides its content (the dataset's identity,
the seed, the node count, the node and the depth range). So

* every process of a node (ranks, DataLoader workers) uses one copy: the first to take the
  directory's lock writes the entry under a temporary name and renames it into place, the others
  wait for the lock and then open it; records are read from storage for it once per node;
* a later run with the same dataset, seed and nodes finds the entry and reads nothing for it;
* another dataset (or a re-converted one), seed or partition has another name, and an entry is
  used only after a quick check (every file present with its recorded size, every shard index
  intact: :func:`~shardkit.formats.verify.verify` ``quick=True``) and after its record count,
  record shape and ``source_key`` field match what is expected; anything else is deleted and
  written again. Entries are fsynced before they get their name, so a crash leaves a nameless
  partial (removed by the next writer), never a torn entry.

Entries stay until deleted (they are a cache, worth keeping between runs); any entry whose job is
not running can be removed at any time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import OutOfSpaceError, SamplerError, ShardkitError
from shardkit.formats import Dataset, PayloadArray, ReadStats
from shardkit.formats.verify import verify
from shardkit.readers.shared.rundir import RunDir
from shardkit.readers.ssd import make_private, write_reservoir
from shardkit.readers.static_cache import StaticCache
from shardkit.readers.stopping import POLL_SECONDS, Stopped

__all__ = ["NodeCache", "DIR_PREFIX", "node_cache_dir", "entry_name"]

logger = logging.getLogger(__name__)

#: The user's private directory of node caches under ``node_cache_dir``.
DIR_PREFIX = "shardkit-node-cache-"
#: Bytes beyond the payload an entry needs (zarr documents, shard indexes, the source_key field).
_OVERHEAD = 1 << 20


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


class NodeCache(StaticCache):
    """This node's pinned records: ``ram_keys`` in RAM, ``disk_keys`` in an entry on local disk.

    It is a :class:`~shardkit.readers.static_cache.StaticCache` over all of them (``keys``,
    ``count`` and ``lookup`` cover both parts), so the pipeline treats it as one; :meth:`fill`
    takes each part's records from where they are.

    Parameters
    ----------
    ram_keys, disk_keys
        Disjoint key sets (any order).
    dataset, dataset_options
        The dataset (a directory or a URL; the disk part is written from it) and the keyword
        arguments the sampler opens it with (:meth:`SamplerOptions.dataset_options`).
    directory
        The user's node-cache directory (:func:`node_cache_dir`), created private if missing.
    name
        The disk part's entry name (:func:`entry_name`).
    stats
        Where reads from the disk part are counted (the sampler's ``stats.cache``).
    """

    def __init__(
        self,
        ram_keys: np.ndarray,
        disk_keys: np.ndarray,
        *,
        dataset: Path | str,
        directory: Path,
        name: str,
        stats: ReadStats,
        dataset_options: dict[str, Any] | None = None,
    ) -> None:
        ram = np.unique(np.asarray(ram_keys, dtype=np.int64))
        disk = np.unique(np.asarray(disk_keys, dtype=np.int64))
        if np.intersect1d(ram, disk).size:
            raise SamplerError("node cache: the RAM and disk parts overlap (internal error)")
        super().__init__(np.union1d(ram, disk))
        self.ram_keys = ram
        self.disk_keys = disk
        self._in_ram = np.isin(self.keys, ram)
        self._ram_row = np.cumsum(self._in_ram) - 1
        self._disk_row = np.cumsum(~self._in_ram) - 1
        self.dataset = dataset
        self.directory = Path(directory)
        self.entry = self.directory / name
        self._stats = stats
        self._options = dict(dataset_options or {})
        self._disk: Dataset | None = None

    # ------------------------------------------------------------------ loading
    def ensure_loaded(self, payload: PayloadArray, stop: threading.Event | None = None) -> bool:
        """Load the RAM part from ``payload`` and open (first writing, if needed) the disk part."""
        with self._lock:
            if self.data is not None:
                return False
            data = payload.empty(self.ram_keys.size)
            payload.read(self.ram_keys, out=data)
            if self.disk_keys.size and self._disk is None:
                self._disk = self._open_or_build(payload, stop if stop is not None else threading.Event())
            self.data = data
            return True

    def _open_or_build(self, payload: PayloadArray, stop: threading.Event) -> Dataset:
        """The disk part's dataset, written under the directory lock unless a valid one exists."""
        if not self.directory.parent.is_dir():
            raise SamplerError(f"node_cache_dir: expected an existing directory, found {str(self.directory.parent)!r}")
        run = RunDir.claim(self.directory)
        try:
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
        finally:
            run.close()

    def _wait_for_lock(self, run: RunDir, stop: threading.Event) -> int:
        waited = 0.0
        while True:
            fd = run.lock()
            if fd is not None:
                return fd
            if stop.is_set():
                raise Stopped()
            if waited == 0.0:
                logger.info("%s: another process of this node is writing the node cache; waiting", self.entry)
            time.sleep(POLL_SECONDS)
            waited += POLL_SECONDS

    def _build(self, payload: PayloadArray, stop: threading.Event) -> None:
        """Write the entry from the dataset (ascending offsets, once) under a temporary name, then
        rename it into place. Called with the directory lock held, so leftovers of writers that died
        are removed first."""
        for stale in self.directory.glob(".entry-*.building-*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        if self.entry.is_symlink() or self.entry.is_file():
            self.entry.unlink()
        elif self.entry.exists():
            shutil.rmtree(self.entry)
        need = self.disk_keys.size * payload.record_nbytes + _OVERHEAD
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OutOfSpaceError(
                f"{self.directory}: the node cache needs {need} bytes ({self.disk_keys.size} records), the "
                f"filesystem has {free} free; lower node_cache or choose another node_cache_dir"
            )
        tmp = self.directory / f".{self.entry.name}.building-{os.getpid()}-{secrets.token_hex(4)}"
        with Dataset(self.dataset, stats=payload.stats, **self._options) as source:
            write_reservoir(source, self.disk_keys, tmp, stop)
        make_private(tmp)
        _sync_tree(tmp)  # unlike a reservoir, the entry outlives the run: only whole entries get a name
        os.rename(tmp, self.entry)
        _fsync(self.directory)
        logger.info("%s: wrote %d pinned records of this node", self.entry, self.disk_keys.size)

    def _valid_entry(self, payload: PayloadArray) -> Dataset | None:
        """The entry opened, if it holds exactly ``disk_keys`` in the dataset's record format."""
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
            ds.num_records != self.disk_keys.size
            or ds.payload.record != payload.record
            or source is None
            or not np.array_equal(source, self.disk_keys)
        ):
            logger.warning("%s: node cache entry does not hold the expected records; writing it again", self.entry)
            ds.close()
            return None
        return ds

    def release(self) -> None:
        """Free the RAM part and close the disk part (the entry stays for later runs)."""
        with self._lock:
            self.data = None
            if self._disk is not None:
                self._disk.close()
                self._disk = None

    # ------------------------------------------------------------------ serving
    def fill(
        self,
        keys: np.ndarray,
        out: np.ndarray,
        read: Callable[[np.ndarray, np.ndarray], None],
        stats: ReadStats | None = None,
    ) -> np.ndarray:
        """As :meth:`StaticCache.fill`: storage misses land in ``out[:u]``, disk-part hits next
        (read with ascending offsets), RAM-part hits last; returns the row of each key."""
        if self.data is None or (self.disk_keys.size and self._disk is None):
            raise SamplerError("node cache: used before it was loaded (internal error)")
        hit, row = self.lookup(keys)
        in_ram = hit & self._in_ram[row]
        on_disk = hit & ~self._in_ram[row]
        miss_idx, disk_idx, ram_idx = np.flatnonzero(~hit), np.flatnonzero(on_disk), np.flatnonzero(in_ram)
        u, v = int(miss_idx.size), int(disk_idx.size)
        if u:
            read(keys[miss_idx], out)
        if v:
            assert self._disk is not None
            self._disk.payload.read(self._disk_row[row[disk_idx]], out=out[u : u + v])
        if ram_idx.size:
            out[u + v : u + v + ram_idx.size] = self.data[self._ram_row[row[ram_idx]]]
            if stats is not None:
                stats.add("static-cache", 0, int(ram_idx.size) * int(self.data[0].nbytes))
                stats.add_records(int(ram_idx.size))
        rows = np.empty(keys.size, dtype=np.int64)
        rows[miss_idx] = np.arange(u, dtype=np.int64)
        rows[disk_idx] = u + np.arange(v, dtype=np.int64)
        rows[ram_idx] = u + v + np.arange(ram_idx.size, dtype=np.int64)
        return rows
