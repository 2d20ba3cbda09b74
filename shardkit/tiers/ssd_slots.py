"""The SSD tier's reservoirs: two scratch files, rewritten in place, filled while the next chunk is
read; record ``i`` (the ``i``-th smallest key) at byte ``i * record_nbytes`` (docs/design.md §4,
*The pipeline*, SSD reservoirs).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardkit.errors import OutOfSpaceError, SamplerError, TruncatedShardError
from shardkit.formats import PayloadArray
from shardkit.formats.index import ShardIndex
from shardkit.formats.mapping import populate
from shardkit.formats.reader import Destination, ReadStats, gather_into
from shardkit.formats.spec import ShardInfo
from shardkit.stopping import Stopped
from shardkit.stores.atomic import is_out_of_space
from shardkit.tiers.ssd import SsdSpace
from shardkit.tiers.ssd_direct import RESIDENT_SHARE, DirectJob, DirectReads

__all__ = ["ReservoirSlots", "ScratchRecords", "SlotWrite", "SLOT_PREFIX"]

logger = logging.getLogger(__name__)

#: Name prefix of the slot files inside the run's directory.
SLOT_PREFIX = "reservoir-"
#: Bytes copied inside the kernel per :meth:`~shardkit.formats.PayloadArray.copy_to_file` call (a
#: stop request is seen between two); the next chunk is announced while one is copied.
KERNEL_CHUNK_BYTES = 32 << 20
#: Bytes of one slot allocated per ``posix_fallocate`` call of :meth:`ReservoirSlots.preallocate` (a
#: stop request is seen between two).
PREALLOCATE_CHUNK_BYTES = 16 << 20


class RecordSource(Protocol):
    """What the SSD tier needs of the bottom tier's payload: a :class:`~shardkit.formats.PayloadArray`,
    or a mixture's payload over several datasets (:class:`~shardkit.readers.sources.MixedPayload`)."""

    record: Any
    dtype: np.dtype[Any]
    record_nbytes: int
    fill_value: Any

    def empty(self, n: int) -> np.ndarray: ...

    def read(self, keys: np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray: ...


class ScratchRecords(PayloadArray):
    """Records ``0 .. count - 1`` of one slot file (one dense shard, through the slot's own
    descriptor), read with the dataset reader's read path, or, given the slot's shared mapping
    (``mapped``, a slot on tmpfs), copied from it: one ``memcpy`` a record from pages already in
    the process's page tables, where a ``preadv`` looks each page up in the file and copies it in the
    kernel, and the read plan sorts and plans every block first."""

    def __init__(self, fd: int, path: Path, like: RecordSource, count: int, stats: ReadStats, gap_bytes: int,
                 mapped: mmap.mmap | None = None) -> None:  # fmt: skip
        rec = like.record_nbytes
        size = os.fstat(fd).st_size
        if size < count * rec:
            raise TruncatedShardError(f"{path}: SSD reservoir of {count} records should hold {count * rec} bytes, "
                                      f"found {size}")  # fmt: skip
        self.path = path
        self.record, self.dtype, self.record_nbytes = like.record, like.dtype, rec
        self.shape = (count, *like.record.shape)
        self.num_records, self.records_per_shard = count, max(1, count)
        self.codec, self.fill_value = None, like.fill_value
        self._init_state([ShardInfo(path.name, 0, count, count * rec, 0)], stats, gap_bytes)
        self._slot_fd = fd
        self._dense = ShardIndex.dense(count, self.records_per_shard, rec)
        self._mapped: np.ndarray | None = None
        if mapped is not None and len(mapped) >= count * rec:
            self._mapped = np.frombuffer(mapped, dtype=np.uint8, count=count * rec).reshape(count, rec)

    def read_into(self, keys: np.ndarray | list[int], dest: Destination) -> None:
        """:meth:`PayloadArray.read_into`, from the slot's mapping when it has one (each record
        counted as one request of its bytes)."""
        if self._mapped is None:
            super().read_into(keys, dest)
            return
        keys = self.checked_keys(keys, dest)
        if keys.size == 0:
            return
        gather_into(self._mapped, keys, dest)
        starts = keys * self.record_nbytes
        self.stats.add_runs(str(self.path), starts, starts + self.record_nbytes)
        self.stats.add_records(int(keys.size))

    def _fd(self, i: int) -> int:
        return self._slot_fd

    def index(self, i: int) -> ShardIndex:
        return self._dense

    def shard_location(self, i: int) -> str:
        return str(self.path)

    def close(self) -> None:
        """Nothing to close: the descriptor belongs to the slot."""


@dataclass(eq=False)
class SlotWrite:
    """A reservoir being written into a slot (:meth:`ReservoirSlots.start`); ``job``: its direct
    reads in flight, if it is read that way."""

    slot: int
    payload: RecordSource
    keys: np.ndarray
    stop: threading.Event
    job: DirectJob | None = None

    @property
    def in_flight(self) -> bool:
        """The device is reading the reservoir now (:meth:`ReservoirSlots.finish` waits for it)."""
        return self.job is not None


class ReservoirSlots:
    """The SSD tier's ``slots`` slot files in the run directory ``space`` and the writer thread that
    fills them through a copy buffer of ``copy_bytes`` (two halves, one read while the other is
    written), allocated like the rows of ``like`` (docs/design.md §4)."""

    def __init__(self, space: SsdSpace, like: RecordSource, copy_bytes: int, slots: int = 2) -> None:
        rec = like.record_nbytes
        self._like = like
        self._halves = 2 if copy_bytes >= 2 * rec else 1
        self._rows = max(1, copy_bytes // self._halves // rec)
        #: The copy buffer's halves, allocated by the first buffered write (the in-kernel copy needs
        #: none, and a page-aligned buffer has its pages mapped as it is made).
        self._buffers: list[np.ndarray] = []
        self.paths = [space.path / f"{SLOT_PREFIX}{i}" for i in range(slots)]
        self._fds: list[int] = []
        self._closed = threading.Lock()
        try:
            for p in self.paths:
                self._fds.append(space.create_file(p.name))
        except BaseException:
            self.close()
            raise
        #: Direct reads of the dataset into the slots' mappings (``None``: copies only), and each
        #: slot mapped (shared) as far as its reservoirs reach, made by :meth:`preallocate`.
        self._direct = DirectReads(like) if DirectReads.suits(like, space.path) else None  # type: ignore[arg-type]
        self._maps: list[mmap.mmap | None] = [None] * slots
        self._views: list[memoryview | None] = [None] * slots
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardkit-ssd-writer")
        self._allocating = threading.Event()  # set: the preallocation thread must stop
        self._allocator: threading.Thread | None = None
        #: What :meth:`preallocate` was asked for and its thread has not reached yet, whether that
        #: thread has finished its work (a new call then starts another), and each slot's bytes
        #: allocated so far from its front.
        self._alloc_lock = threading.Lock()
        self._targets: deque[tuple[int, int]] = deque()
        self._alloc_idle = True
        self._allocated = [0] * slots
        #: The next reservoir's keys (:meth:`expect`), and the announcement of its first chunk once
        #: submitted (during the current reservoir's last chunk).
        self._next: np.ndarray | None = None
        self._ahead: tuple[np.ndarray, Future[None]] | None = None

    def preallocate(self, targets: Iterable[tuple[int, int]]) -> None:
        """Allocate the first ``nbytes`` of slot ``slot`` for each ``(slot, nbytes)`` of ``targets``,
        in that order (the order the writes will need them), in a background thread, chunk by chunk
        from the front (where writes begin), so the first pass over the slots rewrites allocated
        space and no page is allocated that no reservoir uses. Later calls queue behind earlier ones.

        A fresh file's pages are allocated (on tmpfs also zeroed) by the very write that fills them,
        on the disk -> SSD copy's thread: about a third of a first epoch's copy cost on tmpfs, paid
        again by nothing in later epochs. A failure (a full disk, no ``fallocate`` support) only
        ends the preallocation: the writes then allocate, and report a full disk, as before."""
        targets = [(int(slot), int(nbytes)) for slot, nbytes in targets if nbytes > 0]
        with self._alloc_lock:
            if self._allocating.is_set() or not self._fds:
                return
            if self._direct is not None:
                self._map_slots(targets)
            self._targets.extend(targets)
            if not self._alloc_idle or not self._targets:
                return
            self._alloc_idle = False
            self._allocator = threading.Thread(target=self._allocate, name="shardkit-ssd-allocator", daemon=True)
            self._allocator.start()

    def _allocate(self) -> None:
        """The preallocation thread: grow each queued slot to its target, until none is left."""
        while True:
            with self._alloc_lock:
                if not self._targets:
                    self._alloc_idle = True
                    return
                slot, nbytes = self._targets.popleft()
            fd = self._fds[slot]
            while self._allocated[slot] < nbytes:
                if self._allocating.is_set():
                    return
                offset = self._allocated[slot]
                length = min(PREALLOCATE_CHUNK_BYTES, nbytes - offset)
                try:
                    os.posix_fallocate(fd, offset, length)
                    m = self._maps[slot]
                    if m is not None and offset + length <= len(m):
                        populate(m, offset, length)
                except OSError as exc:
                    logger.debug("SSD reservoir preallocation stopped: %s", exc)
                    self._allocating.set()
                    return
                self._allocated[slot] = min(offset + PREALLOCATE_CHUNK_BYTES, nbytes)

    def _map_slots(self, targets: list[tuple[int, int]]) -> None:
        """Map each slot of ``targets`` not mapped yet, as far as its largest target (the file grows
        to that size, sparse: the preallocation allocates it)."""
        for slot in {slot for slot, _ in targets}:
            if self._maps[slot] is not None:
                continue
            span = max(nbytes for s, nbytes in targets if s == slot)
            fd = self._fds[slot]
            try:
                if os.fstat(fd).st_size < span:
                    os.ftruncate(fd, span)
                self._maps[slot] = m = mmap.mmap(fd, span)
            except (OSError, ValueError) as exc:
                logger.debug("SSD reservoir slot %d not mapped (%s): copying into it", slot, exc)
                continue
            self._views[slot] = memoryview(m)

    def _stop_preallocating(self) -> None:
        """Stop the preallocation thread and wait for it (before a slot is emptied or closed)."""
        with self._alloc_lock:
            self._allocating.set()
            allocator = self._allocator
        if allocator is not None:
            allocator.join()

    def _cut(self, fd: int, nbytes: int) -> None:
        """Cut slot file ``fd`` to ``nbytes`` (0: emptied after a failed or stopped write), the
        preallocation stopped first (it would extend the file again)."""
        self._stop_preallocating()
        os.ftruncate(fd, nbytes)

    def expect(self, keys: np.ndarray | None) -> None:
        """The keys (ascending, distinct) the next :meth:`write` will most likely copy: the in-kernel
        copy announces their first chunk while it copies the current reservoir's last one, so the
        device is not idle between two reservoirs (a hint: another write announces its own keys).

        In a first epoch the reservoirs grow from a small one; one or two chunks each, every one of
        them waited for its announcement (the device's read) and then copied, with nothing read
        while the copy ran."""
        self._next = None if keys is None or keys.size == 0 else keys

    def _announced(self, keys: np.ndarray) -> Future[None] | None:
        """The announcement of ``keys`` submitted ahead (by the previous write), else None; any
        other one submitted ahead is waited for (its keys are not this write's)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead[0].shape == keys.shape and np.array_equal(ahead[0], keys):
            return ahead[1]
        wait([ahead[1]])
        return None

    def write(self, slot: int, payload: RecordSource, keys: np.ndarray, stop: threading.Event) -> int:
        """Copy records ``keys`` (ascending, distinct) of ``payload`` into slot ``slot`` in one pass;
        returns the bytes written. On failure or ``stop`` the slot is emptied; a full disk is an
        :class:`~shardkit.errors.OutOfSpaceError`."""
        return self.finish(self.start(slot, payload, keys, stop))

    def start(self, slot: int, payload: RecordSource, keys: np.ndarray, stop: threading.Event) -> SlotWrite:
        """Begin :meth:`write`: direct reads (:meth:`_start_direct`) are in flight on return, so the
        caller can prepare the next reservoir while the device works (:attr:`SlotWrite.in_flight`);
        any other copy is made by :meth:`finish`."""
        write = SlotWrite(slot, payload, keys, stop)
        if isinstance(payload, PayloadArray) and payload.can_copy_to_file():
            write.job = self._start_direct(slot, payload, keys, stop)
        return write

    def finish(self, write: SlotWrite) -> int:
        """Complete ``write`` (see :meth:`write`); returns the bytes written."""
        slot, payload, keys, stop = write.slot, write.payload, write.keys, write.stop
        fd, path = self._fds[slot], self.paths[slot]
        rec = payload.record_nbytes
        if write.job is not None:
            assert self._direct is not None
            try:
                self._direct.finish(write.job)
            except BaseException:
                self._cut(fd, 0)
                raise
            return int(keys.size) * rec
        if isinstance(payload, PayloadArray) and payload.can_copy_to_file():  # a mixture's records: buffered
            self._copy_in_kernel(fd, path, payload, keys, stop)
            return int(keys.size) * rec
        if not self._buffers:
            self._buffers = [self._like.empty(self._rows) for _ in range(self._halves)]
        per = self._rows
        pending: Future[None] | None = None
        try:
            for c, a in enumerate(range(0, keys.size, per)):
                if stop.is_set():
                    raise Stopped()
                buf = self._buffers[c % len(self._buffers)]
                if len(self._buffers) == 1 and pending is not None:
                    pending.result()  # one buffer: it is free only once written
                    pending = None
                chunk = keys[a : a + per]
                out = payload.read(chunk, out=buf)[: chunk.size]
                if pending is not None:
                    pending.result()  # chunk c - 1 is written: its half is free for chunk c + 1
                pending = self._writer.submit(_pwrite_all, fd, out, a * rec, path)
            if pending is not None:
                pending.result()
                pending = None
        except BaseException:
            if pending is not None:
                wait([pending])  # never reuse or free a buffer a write still reads
            self._cut(fd, 0)
            raise
        return int(keys.size) * rec

    def _start_direct(self, slot: int, payload: PayloadArray, keys: np.ndarray,
                      stop: threading.Event) -> DirectJob | None:  # fmt: skip
        """Start reading records ``keys`` from the device straight into slot ``slot``'s mapping, the
        whole reservoir at once (:meth:`DirectReads.submit`); ``None``, with nothing written, where
        that cannot be done (no direct reads, the slot not mapped that far, unaligned records,
        records mostly in the page cache)."""
        direct, view = self._direct, self._views[slot]
        rec = payload.record_nbytes
        if direct is None or not direct.enabled or view is None or len(view) < keys.size * rec:
            return None
        runs = direct.runs(keys)
        if runs is None or direct.resident(runs) >= RESIDENT_SHARE:
            return None
        fd = self._fds[slot]
        try:
            if os.fstat(fd).st_size < keys.size * rec:  # cut by a failed write: the mapping past it is not the file's
                os.ftruncate(fd, keys.size * rec)
            return direct.submit(runs, view, 0, stop)  # None: refused before anything was read, copy instead
        except BaseException:
            self._cut(fd, 0)
            raise

    def _copy_in_kernel(self, fd: int, path: Path, payload: PayloadArray, keys: np.ndarray, stop: threading.Event) -> None:
        """The in-kernel copy, chunk by chunk, the writer thread announcing chunk ``c + 1`` while this
        thread copies chunk ``c``."""
        per = max(1, KERNEL_CHUNK_BYTES // payload.record_nbytes)
        starts = list(range(0, keys.size, per))
        expected, self._next = self._next, None
        ahead: Future[None] | None = self._announced(keys[:per])
        if ahead is None:
            ahead = self._writer.submit(payload.announce, keys[:per])
        try:
            for c, a in enumerate(starts):
                if stop.is_set():
                    raise Stopped()
                assert ahead is not None
                ahead.result()
                ahead = None
                if c + 1 < len(starts):
                    ahead = self._writer.submit(payload.announce, keys[starts[c + 1] : starts[c + 1] + per])
                elif expected is not None:  # the next reservoir's first chunk, read while this one is copied
                    first = expected[:per]
                    self._ahead = (first, self._writer.submit(payload.announce, first))
                payload.copy_to_file(keys[a : a + per], fd, first_row=a, announce=False)
        except BaseException as exc:
            if ahead is not None:
                wait([ahead])
            if self._ahead is not None:
                wait([self._ahead[1]])
                self._ahead = None
            self._cut(fd, 0)
            if is_out_of_space(exc):
                raise OutOfSpaceError(f"{path}: no space left on device while writing an SSD reservoir") from None
            raise

    def shrink(self, slot: int, nbytes: int) -> None:
        """Cut slot ``slot`` to its first ``nbytes`` (no later write of the run needs more): the rest
        of its pages are freed now, on the caller's thread, and the preallocation ends (it would
        extend the file again). Pages left for the run's close are freed in the consumer's last call."""
        fd = self._fds[slot]
        if os.fstat(fd).st_size > nbytes:
            self._cut(fd, nbytes)

    def records(self, slot: int, count: int, stats: ReadStats, gap_bytes: int) -> ScratchRecords:
        """The ``count`` records just written to slot ``slot``, for reading back."""
        return ScratchRecords(self._fds[slot], self.paths[slot], self._like, count, stats, gap_bytes, self._maps[slot])

    def close(self) -> None:
        """Stop the writer thread and close the slot files (idempotent; the files go with the
        run's directory)."""
        with self._closed:
            writer = getattr(self, "_writer", None)
            if writer is not None:
                self._stop_preallocating()
                writer.shutdown(wait=True)
            direct = getattr(self, "_direct", None)
            if direct is not None:
                direct.close()
            for i, m in enumerate(getattr(self, "_maps", [])):
                view, self._views[i] = self._views[i], None
                if view is not None:
                    view.release()
                if m is not None:
                    with suppress(BufferError):  # a failed read's traceback still holds a view: unmapped with it
                        m.close()
            self._maps = []
            for fd in self._fds:
                os.close(fd)
            self._fds = []


def _pwrite_all(fd: int, records: np.ndarray, offset: int, path: Path) -> None:
    """Write ``records`` at ``offset`` of ``fd`` completely; a full disk is an OutOfSpaceError."""
    view = records.reshape(-1).view(np.uint8).data
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            if n <= 0:
                raise SamplerError(f"{path}: writing an SSD reservoir made no progress at offset {offset}")
            view, offset = view[n:], offset + n
    except OSError as exc:
        if is_out_of_space(exc):
            raise OutOfSpaceError(f"{path}: no space left on device while writing an SSD reservoir") from None
        raise
