"""The batch buffers of one run: a bounded pool that recycles a buffer only when nobody holds it
(docs/design.md §4, *The pipeline*, batch buffers).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardkit.formats.reader import aligned_empty
from shardkit.stopping import Stopped

__all__ = ["BatchBuffer", "BatchPool", "BufferMemory", "HOLD_BATCHES"]

#: Batches a consumer may keep after it received them before the pool stops waiting for them: the
#: one it works on and the one before (``for b in sampler`` holds it while ``__next__`` runs).
HOLD_BATCHES = 2
#: How often a reader that waits for a buffer re-checks the pool (dropping a reference sends no signal).
_POLL_SECONDS = 0.002


@runtime_checkable
class BufferMemory(Protocol):
    """Where a pool's buffers live, and whether something outside this process still uses one."""

    #: Batches the other side may hold besides the consumer's :data:`HOLD_BATCHES` (the pool waits
    #: that much longer before retiring a buffer, and may own that many more).
    extra_hold: int

    def allocate(self, rows: int, record_shape: tuple[int, ...], dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
        """An uninitialised C-contiguous ``[rows, *record_shape]`` array whose ``base`` owns the memory,
        starting ``offset`` bytes past a page (the contract of :func:`~shardkit.formats.reader.aligned_empty`)."""
        ...

    def busy(self, owner: np.ndarray) -> bool:
        """Does another process still use the buffer whose owning array is ``owner``?"""
        ...


@dataclass(eq=False)
class BatchBuffer:
    """One pooled buffer: ``array`` is ``[rows, *record_shape]``; ``owner`` the array that owns the
    memory (``array.base``), whose reference count tells whether anybody outside holds a view."""

    array: np.ndarray
    owner: np.ndarray
    baseline: int = 0
    array_baseline: int = 0
    #: The consumer's batch count when this buffer was handed over (``None``: with the pipeline).
    handed: int | None = None
    in_use: bool = True
    number: int = field(default=0)
    memory: BufferMemory | None = None

    def referenced(self) -> bool:
        """Does anything besides the pool hold the memory (a view of it, or the pool's own view, or
        another process the memory handed it to)?"""
        if sys.getrefcount(self.owner) > self.baseline or sys.getrefcount(self.array) > self.array_baseline:
            return True
        return self.memory is not None and self.memory.busy(self.owner)


class BatchPool:
    """At most ``capacity`` buffers of ``rows`` records each, reused only when nobody holds them; a
    buffer handed out more than ``hold`` batches ago and still referenced is retired (counted in
    :attr:`retired`) and replaced, so the reader never waits for it.

    Every buffer is ``[rows, *record_shape]`` of ``dtype`` and starts ``row_offset`` bytes past a page
    (what the dataset's decoder writes fastest; 0: page aligned), in process memory or in ``memory``
    (where buffers live, e.g. shared memory; its ``extra_hold`` added to ``capacity`` and ``hold``);
    ``capacity`` does not count retired buffers.
    """

    def __init__(
        self,
        rows: int,
        record_shape: tuple[int, ...],
        dtype: np.dtype[Any],
        capacity: int,
        hold: int = HOLD_BATCHES,
        memory: BufferMemory | None = None,
        row_offset: int = 0,
    ) -> None:
        self.rows = int(rows)
        #: Bytes past a page where a buffer starts (the decoder's fastest rows).
        self.row_offset = int(row_offset)
        self.record_shape = tuple(record_shape)
        self.dtype = np.dtype(dtype)
        extra = 0 if memory is None else max(0, int(memory.extra_hold))
        self.capacity = max(1, int(capacity)) + extra
        self.hold = int(hold) + extra
        self.memory = memory
        self._buffers: list[BatchBuffer] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: Batches the consumer has received so far (advanced by :meth:`hand_over`).
        self.delivered = 0
        #: Buffers allocated and retired over the pool's life.
        self.allocated = 0
        self.retired = 0

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer."""
        return self.rows * int(np.prod(self.record_shape, dtype=np.int64)) * self.dtype.itemsize

    def acquire(self, stop: threading.Event) -> BatchBuffer:
        """A buffer nobody references, for the pipeline to fill (blocks until there is one; raises
        :class:`~shardkit.stopping.Stopped` when ``stop`` is set)."""
        while True:
            with self._changed:
                buf = self._take()
                if buf is not None:
                    return buf
                # Woken by the consumer asking for a batch (it has just dropped the one before
                # last, in the usual loop), else re-checked every few milliseconds.
                self._changed.wait(_POLL_SECONDS)
            if stop.is_set():
                raise Stopped()

    def try_acquire(self) -> BatchBuffer | None:
        """A buffer nobody references, or ``None`` at once when the pool has none to give (for a
        block the reader opens ahead, which must not wait for the consumer)."""
        with self._changed:
            return self._take()

    def consumer_waits(self) -> None:
        """The consumer asks for its next batch: buffers it dropped may be free now."""
        with self._changed:
            self._changed.notify_all()

    def _take(self) -> BatchBuffer | None:
        for buf in self._buffers:
            if not buf.in_use and not buf.referenced():
                buf.in_use, buf.handed = True, None
                return buf
        if len(self._buffers) >= self.capacity:
            # Full: give up buffers the consumer kept for longer than `hold` batches.
            kept = [b for b in self._buffers
                    if not b.in_use and b.handed is not None and b.handed <= self.delivered - self.hold]  # fmt: skip
            if not kept:
                return None
            for b in kept:
                self._buffers.remove(b)
            self.retired += len(kept)
        if self.memory is None:
            array = aligned_empty(self.rows, self.record_shape, self.dtype, self.row_offset)
        else:
            array = self.memory.allocate(self.rows, self.record_shape, self.dtype, self.row_offset)
        owner = array.base
        assert isinstance(owner, np.ndarray)
        buf = BatchBuffer(array=array, owner=owner, number=self.allocated, memory=self.memory)
        del array, owner  # the baseline counts the pool's own references only
        buf.baseline = sys.getrefcount(buf.owner)
        buf.array_baseline = sys.getrefcount(buf.array)
        self._buffers.append(buf)
        self.allocated += 1
        return buf

    def hand_over(self, buf: BatchBuffer) -> None:
        """The consumer received the batch in ``buf``: from now on only references decide."""
        with self._lock:
            self.delivered += 1
            buf.handed = self.delivered
            buf.in_use = False

    def release(self, buf: BatchBuffer) -> None:
        """The pipeline gives ``buf`` back without handing it over (e.g. a batch it abandoned)."""
        with self._lock:
            buf.in_use = False

    def __len__(self) -> int:
        return len(self._buffers)
