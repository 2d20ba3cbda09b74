"""Files and memory made resident ahead of their use: ``madvise`` without the GIL (many ranges a
system call), and :class:`MappedFile`, a shard file mapped once, its ranges announced, then
populated, with what this process made resident remembered (docs/design.md §4, *Static cache*
and the codec read path). Below ``tiers``: the reader and the tiers both use it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from contextlib import suppress
from typing import Any

import numpy as np

from shardkit.formats.arrays import distinct_sorted

__all__ = [
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "MappedFile",
    "in_core",
    "libc_madvise",
    "populate",
    "populate_ranges",
    "reserve_ranges",
]

#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): map pages ahead of writing them.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: ``madvise(MADV_POPULATE_READ)`` (Linux 5.14): map a file's pages (read from it where they are not
#: in the page cache) ahead of reading them.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: ``madvise(MADV_WILLNEED)``: for a file's mapping, the kernel starts reading the range (as
#: ``posix_fadvise(POSIX_FADV_WILLNEED)`` would) and returns.
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
#: ``madvise(MADV_DONTNEED)``: unmap a range's pages from this process (a file's stay in the page cache).
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
#: ``madvise(2)`` called through ctypes, which lets go of the GIL for the call (None: not found).
libc_madvise: Any = None
with suppress(OSError, AttributeError, TypeError):
    libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
    libc_madvise.argtypes, libc_madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int

#: ``mincore(2)`` called through ctypes (None: not found): which pages of a mapping are in memory.
libc_mincore: Any = None
with suppress(OSError, AttributeError, TypeError):
    libc_mincore = ctypes.CDLL(None, use_errno=True).mincore
    libc_mincore.argtypes, libc_mincore.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int


def in_core(m: mmap.mmap, offset: int, length: int) -> np.ndarray | None:
    """One flag a page of bytes ``[offset, offset + length)`` (page aligned) of mapping ``m``: in the
    page cache (``mincore``); ``None`` where the kernel cannot tell or :data:`libc_mincore` is missing."""
    if libc_mincore is None:
        return None
    vec = np.zeros(-(-length // mmap.PAGESIZE), dtype=np.uint8)
    view = (ctypes.c_char * length).from_buffer(m, offset)  # an export: the mapping stays open
    try:
        failed = libc_mincore(ctypes.addressof(view), length, vec.ctypes.data) != 0
    finally:
        del view
    return None if failed else vec & 1


def _all_in_core(m: mmap.mmap, offset: int, length: int) -> bool:
    flags = in_core(m, offset, length)
    return flags is not None and bool(flags.all())

#: ``process_madvise(2)`` (Linux 5.10; any advice on the calling process since 6.13): one system
#: call for many ranges (None: not found; ``_batched[0]`` turns False once the kernel refuses it).
_process_madvise: Any = None
with suppress(OSError, AttributeError, TypeError):
    _process_madvise = ctypes.CDLL(None, use_errno=True).process_madvise
    _process_madvise.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint)
    _process_madvise.restype = ctypes.c_ssize_t
_batched = [ctypes.sizeof(ctypes.c_void_p) == 8 and ctypes.sizeof(ctypes.c_size_t) == 8]
#: Ranges per ``process_madvise`` call (the kernel's ``UIO_MAXIOV``).
_IOV_MAX = 1024
#: ``(pid, pidfd)``: this process's pidfd (reopened in a forked child).
_self_pidfd: list[tuple[int, int]] = []


def populate(m: mmap.mmap, offset: int, length: int, advice: int = MADV_POPULATE_WRITE) -> None:
    """``madvise(MADV_POPULATE_WRITE)`` (or ``advice``) on bytes ``[offset, offset + length)`` of
    mapping ``m`` (``offset`` page aligned): allocate and map its pages; raises OSError as
    ``madvise`` fails.

    The call runs without the GIL: ``mmap.madvise`` holds it for the whole call, and populating a
    cache's pages takes a second of CPU per 753 MB of 4 KiB pages, during which no other thread of
    the process (the reader, the assembler, the training loop) ran a line of Python."""
    if length <= 0:
        return
    if libc_madvise is None:
        m.madvise(advice, offset, length)
        return
    view = (ctypes.c_char * length).from_buffer(m, offset)  # an export: m cannot be closed under the call
    try:
        if libc_madvise(ctypes.addressof(view), length, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del view


def reserve_ranges(rows: np.ndarray, rows_at: int, record_nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The byte ranges ``[start, end)`` of a region or file holding ``rows`` (at byte ``rows_at``,
    ``record_nbytes`` each): what to allocate before a cache's rows are written, or to make resident
    before a mapped file's records are read, as whole pages (what the kernel allocates), rows
    on the same or adjacent pages in one range; and the smallest row of each range. A handful of
    ranges per block whatever the number of rows, where a range per run of consecutive rows cost a
    system call for every few small records."""
    order = distinct_sorted(rows)
    if order.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    rec = int(record_nbytes)
    lo = (rows_at + order * rec) // mmap.PAGESIZE
    hi = (rows_at + (order + 1) * rec - 1) // mmap.PAGESIZE + 1  # one past the last page
    new = np.ones(order.size, dtype=bool)
    new[1:] = lo[1:] > hi[:-1]  # a page between them is not wanted: a new range
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], order.size) - 1
    return lo[heads] * mmap.PAGESIZE, hi[tails] * mmap.PAGESIZE, order[heads]


def _pidfd() -> int:
    """A pidfd of this process (``process_madvise`` names its target by one)."""
    pid = os.getpid()
    if _self_pidfd and _self_pidfd[0][0] == pid:
        return _self_pidfd[0][1]
    if _self_pidfd:  # a forked child: the descriptor names the parent
        with suppress(OSError):
            os.close(_self_pidfd.pop()[1])
    fd = os.pidfd_open(pid)
    _self_pidfd[:] = [(pid, fd)]
    return fd


def populate_ranges(m: mmap.mmap, ranges: list[tuple[int, int]], advice: int = MADV_POPULATE_WRITE) -> bool:
    """``MADV_POPULATE_WRITE`` (or ``advice``) on every byte range ``(offset, length)`` of mapping ``m``
    (each from the start of its first page) in one system call per ``_IOV_MAX`` ranges
    (``process_madvise`` on this process), without the GIL; True when every range was done, False
    when the caller must go range by range (the kernel lacks the call, or some range failed).

    A block's ranges are scattered over a region or a file, hundreds of ranges a block: one ctypes
    call each gave the GIL up and took it back hundreds of times a block, and with the assembler and
    the training loop running each take waited for another thread's switch interval (a 753 MB first
    epoch's reserves took 7 s of the reader's wall time for 0.35 s of CPU)."""
    if not ranges:
        return True
    start = np.array([a for a, _ in ranges], dtype=np.int64)
    return _advise(m, start, start + np.array([n for _, n in ranges], dtype=np.int64), advice)


def _advise(m: mmap.mmap, start: np.ndarray, end: np.ndarray, advice: int) -> bool:
    """:func:`populate_ranges` of byte ranges ``[start[k], end[k])`` (int64 arrays, not empty)."""
    if _process_madvise is None or not _batched[0]:
        return False
    iov = np.empty((start.size, 2), dtype=np.uint64)  # struct iovec: base, length
    start = start - start % mmap.PAGESIZE
    view = (ctypes.c_char * len(m)).from_buffer(m)  # an export: m cannot be closed under the call
    try:
        iov[:, 0] = start + ctypes.addressof(view)
        iov[:, 1] = end - start
        pidfd = _pidfd()
        for a in range(0, start.size, _IOV_MAX):
            part = iov[a : a + _IOV_MAX]
            want = int(part[:, 1].sum())
            got = _process_madvise(pidfd, part.ctypes.data, part.shape[0], advice, 0)
            if got != want:
                if got < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
                    _batched[0] = False  # not on this kernel: range by range from now on
                return False
    except OSError:  # no pidfd_open (kernel before 5.3)
        _batched[0] = False
        return False
    finally:
        del view
    return True


class MappedFile:
    """A file mapped private and read-only (nothing done to the mapping reaches the file), whose
    ranges a reader announces and then makes resident, and which of its units (the caller's: pages
    for streams of any size, records for fixed-size ones) this process made resident: pages once
    mapped stay mapped, so those are not asked of the kernel again.

    A block's ranges are all announced (:meth:`announce`) before any is populated (:meth:`populate`,
    ``MADV_POPULATE_READ``: the kernel reads what the page cache lacks), so a cold device gets all
    of them queued at once where populating alone reads one at a time."""

    def __init__(self, fd: int, nbytes: int = 0, unit: int = mmap.PAGESIZE) -> None:
        self.map = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
        #: The whole mapping as bytes (slices of it are views, not copies).
        self.bytes = memoryview(self.map)
        self.unit = int(unit)
        #: Which units (bytes ``[k * unit, (k + 1) * unit)``) this process made resident; kept by the caller.
        self.resident = np.zeros(-(-len(self.map) // self.unit), dtype=bool)

    @classmethod
    def open(cls, fd: int, nbytes: int = 0, unit: int = mmap.PAGESIZE) -> MappedFile | None:
        """The first ``nbytes`` of open file ``fd`` (0: all of it) mapped, or ``None`` where it cannot be."""
        try:
            return cls(fd, nbytes, unit)
        except (OSError, ValueError):
            return None

    def __len__(self) -> int:
        return len(self.map)

    def _advise(self, starts: np.ndarray, ends: np.ndarray, advice: int) -> bool:
        """``advice`` on byte ranges ``[starts[k], ends[k])`` in one system call per 1,024 (arrays as
        they are: a block makes a few calls per shard); False: the caller goes range by range."""
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        keep = ends > starts
        if not keep.all():
            starts, ends = starts[keep], ends[keep]
        return starts.size == 0 or _advise(self.map, starts, ends, advice)

    @staticmethod
    def _ranges(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
        """Ranges ``[starts[k], ends[k])`` as ``(offset, length)`` from the start of their first page."""
        a = np.asarray(starts, dtype=np.int64)
        a = a - a % mmap.PAGESIZE
        return [(x, n) for x, n in zip(a.tolist(), (np.asarray(ends) - a).tolist()) if n > 0]

    def announce(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """``MADV_WILLNEED`` on byte ranges ``[starts[k], ends[k])``: the kernel starts reading them
        all and returns (advice: a range it refuses is still read when populated). Without the GIL,
        one system call per 1,024 ranges (else one a range): the call returns once the reads are
        queued, which on a busy device means waiting for room in its queue, and ``mmap.madvise``
        held the GIL all that time (the assembler and the training loop stopped with the reader)."""
        if self._advise(starts, ends, MADV_WILLNEED):
            return
        for a, n in self._ranges(starts, ends):
            with suppress(OSError):
                populate(self.map, a, n, MADV_WILLNEED)

    def populate(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Make byte ranges ``[starts[k], ends[k])`` resident (``MADV_POPULATE_READ``, batched, else
        range by range); raises OSError when one cannot be (a file truncated under the mapping)."""
        if not self._advise(starts, ends, MADV_POPULATE_READ):
            for a, n in self._ranges(starts, ends):
                populate(self.map, a, n, MADV_POPULATE_READ)

    def _pages(self, start: int, end: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` widened to whole pages of the mapping."""
        page = mmap.PAGESIZE
        return start - start % page, min(len(self.map), -(-end // page) * page)

    def cached(self, start: int, end: int, sample: int = 0) -> bool:
        """Whether the pages of bytes ``[start, end)`` are in the page cache (``mincore``): every page,
        or with ``sample`` only that many spread evenly over the range (the kernel looks each page
        up, which costs about a tenth of mapping it); False when the kernel cannot tell. For a file
        the caller neither owns nor may write, the kernel answers only for the pages this process
        has mapped (``mincore(2)``), so such files read False."""
        a, b = self._pages(start, end)
        if libc_mincore is None or b <= a:
            return False
        page = mmap.PAGESIZE
        pages = (b - a) // page
        if 0 < sample < pages:
            at = a + np.linspace(0, pages - 1, sample).astype(np.int64) * page
            return all(_all_in_core(self.map, x, page) for x in at.tolist())
        return _all_in_core(self.map, a, b - a)

    def drop(self, start: int, end: int) -> None:
        """Unmap the pages of bytes ``[start, end)`` from this process (``MADV_DONTNEED``; they stay in
        the page cache, and a later access maps them again): mapped file pages count in the process's
        RSS, so a reader that gathers from a mapping window by window keeps one window in it."""
        a, b = self._pages(start, end)
        with suppress(OSError):
            populate(self.map, a, b - a, MADV_DONTNEED)

    def close(self) -> None:
        """Let go of the mapping (a view still alive keeps it until it goes)."""
        with suppress(BufferError):
            self.bytes.release()
            self.map.close()
