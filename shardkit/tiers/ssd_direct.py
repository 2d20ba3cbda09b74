"""Disk -> SSD reservoir reads that skip the page cache: ``O_DIRECT`` reads of the dataset's records
straight into a tmpfs slot file's mapping (docs/design.md §4, *The pipeline*, SSD reservoirs).

The in-kernel copy (``sendfile``) reads each record into a fresh page-cache page of the dataset and
copies it into the slot: the copy and the page-cache allocation were most of a cold first epoch's
fill. A direct read lets the device write the slot's own pages (mapped and zeroed ahead by the
preallocation thread), so the filling thread only waits. Used when the slots are on tmpfs (a
direct read into a disk file's mapping races its writeback), the records' offsets and size are
multiples of :data:`DIRECT_ALIGN`, and the records are not in the page cache (a direct read would
read the device again where the page cache already holds them).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.errors import TruncatedShardError
from shardkit.formats import PayloadArray
from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.mapping import in_core, libc_mincore
from shardkit.stopping import Stopped

__all__ = ["DIRECT_ALIGN", "DIRECT_THREADS", "DirectJob", "DirectReads", "on_tmpfs"]

logger = logging.getLogger(__name__)

#: Offsets, lengths and memory of an ``O_DIRECT`` read are multiples of the device's logical block
#: size; 512 bytes is the smallest there is (a larger one makes the first read fail, see
#: :meth:`DirectReads.submit`).
DIRECT_ALIGN = 512
#: Direct reads are synchronous: this many threads keep as many requests at the device.
DIRECT_THREADS = 4
#: A reservoir whose records' first pages are at least this share in the page cache is copied
#: from there (``sendfile``) rather than read from the device again.
RESIDENT_SHARE = 0.5
#: Runs whose first page is looked up (``mincore``) to tell whether a reservoir is in the page cache.
RESIDENT_SAMPLE = 32



def on_tmpfs(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is on a tmpfs (its mount, the longest mount point above it, says so)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, parts[2]
    except OSError:
        return False
    return fstype == "tmpfs"


@dataclass(frozen=True, eq=False)
class DirectJob:
    """The direct reads of one reservoir in flight (:meth:`DirectReads.submit`): its runs
    (``[shard, offset, row, count]``) and the threads' futures."""

    rows: list[list[int]]
    pending: list[Future[None]]


class DirectReads:
    """Direct reads of ``payload``'s records (local, uncompressed, see :meth:`suits`) into memory,
    from :data:`DIRECT_THREADS` threads; its own ``O_DIRECT`` descriptors, and read-only mappings
    of the shard files for asking which pages are in the page cache (``mincore``)."""

    def __init__(self, payload: PayloadArray) -> None:
        self._payload = payload
        self._rec = payload.record_nbytes
        self._starts = np.array([info.start for info in payload.shards], dtype=np.int64)
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._pool: ThreadPoolExecutor | None = None
        #: False once a direct read was refused (the file system or the alignment): copies from then on.
        self.enabled = True

    @staticmethod
    def suits(payload: Any, slot_dir: str | os.PathLike[str]) -> bool:
        """Whether reservoirs of ``payload`` in ``slot_dir`` can be read directly (see the module)."""
        return (isinstance(payload, PayloadArray) and payload.can_copy_to_file()
                and payload.record_nbytes % DIRECT_ALIGN == 0 and on_tmpfs(slot_dir))  # fmt: skip

    def runs(self, keys: np.ndarray) -> np.ndarray | None:
        """``[shard, offset, row, count]`` (int64 rows) of ``keys`` (ascending, distinct): records
        consecutive in a shard and in the destination in one run; ``None`` when an offset is not
        aligned."""
        shard = np.searchsorted(self._starts, keys, side="right") - 1
        offs = np.empty(keys.size, dtype=np.int64)
        shards = distinct_sorted(shard).tolist()
        for i in shards:
            at = shard == i
            offs[at] = self._payload.record_offsets(i, keys[at] - self._starts[i])
        if np.any(offs % DIRECT_ALIGN):
            return None
        head = np.ones(keys.size, dtype=bool)
        head[1:] = (shard[1:] != shard[:-1]) | (offs[1:] != offs[:-1] + self._rec)
        first = np.flatnonzero(head)
        counts = np.diff(np.append(first, keys.size))
        return np.stack([shard[first], offs[first], first, counts], axis=1)

    def resident(self, runs: np.ndarray) -> float:
        """The share of ``runs`` (up to :data:`RESIDENT_SAMPLE` of them, evenly spread) whose first
        page is in the page cache (0 when it cannot be told)."""
        if libc_mincore is None or not runs.size:
            return 0.0
        page = mmap.PAGESIZE
        sample = runs[np.linspace(0, runs.shape[0] - 1, min(RESIDENT_SAMPLE, runs.shape[0])).astype(np.int64)]
        hits = 0
        for shard, off in sample[:, :2].tolist():
            m = self._map(shard)
            flags = None if m is None else in_core(m, off // page * page, page)
            if flags is None:
                return 0.0
            hits += int(flags[0])
        return float(hits / sample.shape[0])

    def _map(self, i: int) -> mmap.mmap | None:
        """Shard ``i`` mapped copy-on-write (never written): only asked which pages are cached."""
        m = self._maps.get(i)
        if m is None:
            try:
                m = self._maps[i] = mmap.mmap(self._payload._fd(i), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                return None
        return m

    def _fd(self, i: int) -> int:
        """Shard ``i`` opened again with ``O_DIRECT``, through the reader's own descriptor (the file
        it resolved and checked, whatever its path names now)."""
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(f"/proc/self/fd/{self._payload._fd(i)}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        return fd

    def submit(self, runs: np.ndarray, dest: memoryview, first_row: int, stop: threading.Event) -> DirectJob | None:
        """Start reading every run into ``dest`` (record of run row ``r`` at ``(first_row + r) *
        record_nbytes``) and return at once, the reads in flight (:meth:`finish` waits for them);
        ``None``, with nothing read or counted, when the first direct read is refused (:attr:`enabled`
        turns False: the caller copies instead). The first run is read here (that is where a refusal
        shows); thread ``k`` then reads runs ``1 + k``, ``1 + k + DIRECT_THREADS``, ... in turn, so the
        requests at the device are neighbours in ascending order, and the queue stays
        :data:`DIRECT_THREADS` deep to the reservoir's end (no pause at chunk boundaries). ``stop`` is
        checked between two runs."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DIRECT_THREADS, thread_name_prefix="shardkit-ssd-direct")
        rows = runs.tolist()
        try:
            for shard in distinct_sorted(runs[:, 0]).tolist():  # opened here: the threads only look them up
                self._fd(shard)
            self._read_runs(rows[:1], dest, first_row, stop)
        except OSError as exc:
            logger.debug("SSD reservoir: direct reads refused (%s); copying through the page cache", exc)
            self.enabled = False
            return None
        pending = [self._pool.submit(self._read_runs, rows[1 + k :: DIRECT_THREADS], dest, first_row, stop)
                   for k in range(min(DIRECT_THREADS, len(rows) - 1))]  # fmt: skip
        return DirectJob(rows, pending)

    def finish(self, job: DirectJob) -> None:
        """Wait for every read of ``job``, then raise the first one's error, if any (no read still
        writes into the destination then), or count the bytes in the payload's read statistics."""
        wait(job.pending)
        for f in job.pending:
            f.result()
        stats, rec = self._payload.stats, self._rec
        for shard, off, _, count in job.rows:
            stats.add(str(self._payload.shard_path(shard)), off, count * rec)
        stats.add_records(sum(row[3] for row in job.rows))

    def _read_runs(self, rows: list[list[int]], dest: memoryview, first_row: int, stop: threading.Event) -> None:
        """Read runs ``rows`` (``[shard, offset, row, count]``) one after the other, until ``stop``."""
        rec = self._rec
        for shard, off, row, count in rows:
            if stop.is_set():
                raise Stopped()
            at, nbytes = (first_row + row) * rec, count * rec
            fd, done = self._fds[shard], 0
            while done < nbytes:
                n = os.preadv(fd, [dest[at + done : at + nbytes]], off + done)
                if n <= 0:
                    raise TruncatedShardError(f"{self._payload.shard_path(shard)}: expected {nbytes} bytes at "
                                              f"offset {off}, the file ended after {done}")  # fmt: skip
                done += n

    def close(self) -> None:
        """Stop the threads, close the descriptors and mappings (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        for m in self._maps.values():
            with suppress(BufferError):
                m.close()
        self._maps = {}


