"""Batches handed from a DataLoader worker to the main process as shared-memory file descriptors
instead of copies; two counters per buffer (sent, released) say when it may be reused, and the main
process keeps each buffer mapped while its worker lives, so a segment's descriptor is sent with its
first batch only (docs/design.md §6)."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from shardkit._extras import import_extra

if TYPE_CHECKING:
    import torch
else:
    torch = import_extra("torch", "torch", needed_by="shardkit.adapters.torch")

__all__ = ["SharedBatch", "SharedBatchMemory", "kept_segments", "release_exited", "shared_batch"]

#: Bytes after each buffer's payload: ``[sent, released, pid, nonce, serial, handed]`` as int64
#: (the counters, which worker's memory made the segment, and whether its descriptor went to the
#: main process already), padded to a cache line.
_HEADER = 64
#: Small fields (labels, keys) travel inside the pickle: a few KiB through the pipe cost less
#: than a shared-memory segment and a file-descriptor transfer of their own.
_INLINE_BYTES = 1 << 20


def _counters(owner: np.ndarray) -> np.ndarray:
    """The ``[sent, released]`` counters of a buffer, from its owning uint8 array."""
    return owner[owner.size - _HEADER : owner.size - _HEADER + 16].view(np.int64)


def _identity(owner: np.ndarray) -> np.ndarray:
    """The ``[pid, nonce, serial]`` of a buffer's segment (the worker, its memory, the segment)."""
    return owner[owner.size - _HEADER + 16 : owner.size - _HEADER + 40].view(np.int64)


def _handed(owner: np.ndarray) -> np.ndarray:
    """``[handed]``: 1 once a batch of the segment was pickled with its file descriptor (worker side)."""
    return owner[owner.size - _HEADER + 40 : owner.size - _HEADER + 48].view(np.int64)


class SharedBatchMemory:
    """A :class:`~shardkit.tiers.buffers.BufferMemory` of shared-memory buffers for a DataLoader worker;
    ``extra_hold`` is how many batches the main process may hold at once besides the worker's own.

    One instance serves every pass of a worker: a buffer whose pool is gone (its pass ended), that
    the main process released and that nothing in the worker views is handed to the next pool
    instead of a new segment, so a later epoch does not fault in its batch memory again."""

    def __init__(self, extra_hold: int) -> None:
        self.extra_hold = int(extra_hold)
        #: Segments created so far (a reused one is not counted again).
        self.created = 0
        # Every segment given out: its owning uint8 array, and the pool's array of it (weakly).
        self._given: list[tuple[np.ndarray, weakref.ref[np.ndarray]]] = []
        self._lock = threading.Lock()  # two passes' pools may allocate at once (see adapters.torch)
        #: Tells this memory's segments from another's of the same worker pid (a pid can be reused).
        self._nonce = int.from_bytes(os.urandom(7), "little")

    def allocate(self, rows: int, record_shape: tuple[int, ...], dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
        """A ``[rows, *record_shape]`` array in a shared-memory segment, ``offset`` bytes past its
        start (a page: the decoder's fastest rows, see ``BatchPool(row_offset=)``), reused when one of
        that size is free; its ``base`` is the segment's uint8 array, whose ``base`` is the torch
        tensor that owns it. The main process finds the array at the same offset (:func:`_rebuild`)."""
        offset = int(offset)
        payload = int(rows) * int(np.prod(record_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        nbytes = offset + payload
        with self._lock:
            owner = self._spare(nbytes)
        if owner is None:
            new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
            if new_shared is not None:
                whole = torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes + _HEADER))
            else:  # pragma: no cover - older PyTorch
                whole = torch.empty(nbytes + _HEADER, dtype=torch.uint8).share_memory_()
            owner = whole.numpy()
            _counters(owner)[:] = 0
            _handed(owner)[:] = 0
            with self._lock:
                self.created += 1
                _identity(owner)[:] = (os.getpid(), self._nonce, self.created)
        array: np.ndarray = owner[offset:nbytes].view(dtype).reshape((int(rows), *record_shape))
        with self._lock:
            self._given.append((owner, weakref.ref(array)))
        return array

    def _spare(self, nbytes: int) -> np.ndarray | None:
        """A segment of ``nbytes`` bytes before its header nobody uses any more (taken off the list), or None."""
        for i, (owner, array) in enumerate(self._given):
            # References to `owner`: the list's tuple, the loop variable and getrefcount's argument;
            # a view of the segment (a batch still held in this process) adds one.
            if owner.size == nbytes + _HEADER and array() is None and sys.getrefcount(owner) <= 3 and not self.busy(owner):
                del self._given[i]
                return owner
        return None

    def busy(self, owner: np.ndarray) -> bool:
        """Has the main process not yet released every batch sent from this buffer?"""
        sent, released = (int(c) for c in _counters(owner))
        return sent != released


def _release(counters: torch.Tensor) -> None:
    counters[1] += 1


class _Kept:
    """A worker's segment as the main process keeps it: the tensor owning its mapping, that
    mapping as a uint8 array, and a torch view of its counters."""

    __slots__ = ("counters", "raw", "whole")

    def __init__(self, whole: torch.Tensor) -> None:
        self.whole = whole
        self.raw: np.ndarray = whole.numpy()
        # A torch view, not a numpy one: the finalizer that releases a batch must not keep alive
        # the array whose death it waits for.
        self.counters = whole[self.raw.size - _HEADER : self.raw.size - _HEADER + 16].view(torch.int64)


#: In the main process, every worker segment received, by ``(pid, nonce, serial)``. Holding the
#: storage keeps its mapping (PyTorch's ``rebuild_storage_fd`` finds it again by the file's
#: identity instead of mapping the segment anew), so a batch's pages are not faulted in again
#: each time a buffer comes back. Dropped once the worker has exited (:func:`release_exited`).
_KEPT: dict[tuple[int, int, int], _Kept] = {}
_KEPT_LOCK = threading.Lock()  # DataLoader's pin-memory thread unpickles too


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process now has that pid
        return True
    return True


def _release_exited_locked() -> None:
    exited = {pid for pid, _, _ in _KEPT if pid != os.getpid() and not _alive(pid)}
    for ident in [ident for ident in _KEPT if ident[0] in exited]:
        del _KEPT[ident]


def release_exited() -> None:
    """Let go of the segments of workers that have exited (their memory is freed once no batch
    views it any more). Runs whenever a new segment arrives and when a ShardLoader's workers stop."""
    with _KEPT_LOCK:
        _release_exited_locked()


def kept_segments() -> list[tuple[int, int, int]]:
    """The ``(pid, nonce, serial)`` of every worker segment this process keeps mapped."""
    with _KEPT_LOCK:
        return list(_KEPT)


def _kept(whole: torch.Tensor) -> _Kept:
    """The kept form of the segment that ``whole`` (just unpickled) maps, kept from now on if new."""
    raw = whole.numpy()
    ident = tuple(int(v) for v in _identity(raw))
    key = (ident[0], ident[1], ident[2])
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
        if kept is None or kept.raw.ctypes.data != raw.ctypes.data:
            _release_exited_locked()
            kept = _KEPT[key] = _Kept(whole)
    return kept


def _rebuild(
    whole: torch.Tensor,
    offset: int,
    shape: tuple[int, ...],
    dtype: str,
    names: list[str],
    payload: str,
    fields: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """In the main process: the batch as tensors viewing the worker's buffer, released when the
    last of them is gone (the segment's first batch: its descriptor came with it)."""
    return _batch(_kept(whole), offset, shape, dtype, names, payload, fields)


def _rebuild_kept(
    ident: tuple[int, int, int],
    offset: int,
    shape: tuple[int, ...],
    dtype: str,
    names: list[str],
    payload: str,
    fields: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """:func:`_rebuild` of a later batch of a segment this process keeps (:data:`_KEPT`): only its
    identity came through the pipe, no descriptor."""
    with _KEPT_LOCK:
        kept = _KEPT.get((int(ident[0]), int(ident[1]), int(ident[2])))
    if kept is None:
        raise RuntimeError(
            f"a DataLoader worker (pid {ident[0]}) sent a batch of shared segment {ident[2]}, which this process "
            "never received: batches of a worker must be unpickled in the process that created its DataLoader"
        )
    return _batch(kept, offset, shape, dtype, names, payload, fields)


def _batch(
    kept: _Kept, offset: int, shape: tuple[int, ...], dtype: str, names: list[str], payload: str, fields: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The batch's tensors viewing ``kept`` at ``offset``; the buffer is released when the last is gone."""
    array = kept.raw[offset : offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize]
    array = array.view(dtype).reshape(shape)
    weakref.finalize(array, _release, kept.counters)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name == payload:
            out[name] = torch.from_numpy(array)  # keeps `array` alive as long as any view of it
        else:
            value = fields[name]
            out[name] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    return out


class SharedBatch(dict[str, "torch.Tensor"]):
    """A worker's dict of tensors whose payload views a :class:`SharedBatchMemory` buffer; pickling it
    sends the buffer's file descriptor and counts a send, unpickling gives a plain dict. A batch whose
    payload a ``collate_fn`` replaced travels as an ordinary dict."""

    def __init__(self, tensors: dict[str, torch.Tensor], payload: str, array: np.ndarray) -> None:
        super().__init__(tensors)
        self._payload = payload
        self._tensor = tensors[payload]
        self._array = array

    def __copy__(self) -> SharedBatch:
        # copy.copy (DataLoader's default_convert clones mutable mappings) must not count a send.
        return SharedBatch(dict(self), self._payload, self._array)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.get(self._payload) is not self._tensor:
            return (dict, (dict(self),))
        array = self._array
        owner = array.base
        assert isinstance(owner, np.ndarray) and isinstance(owner.base, torch.Tensor)
        fields: dict[str, Any] = {}
        for name, value in self.items():
            if name != self._payload:
                small = isinstance(value, torch.Tensor) and value.nbytes <= _INLINE_BYTES and not value.is_shared()
                fields[name] = value.numpy() if small else value
        offset = array.ctypes.data - owner.ctypes.data
        _counters(owner)[0] += 1  # before the worker drops its references (the pool sees one or the other)
        args = (offset, tuple(array.shape), array.dtype.str, list(self), self._payload, fields)
        handed = _handed(owner)
        if handed[0]:  # the main process keeps the segment mapped: its identity finds it
            ident = tuple(int(v) for v in _identity(owner))
            return (_rebuild_kept, (ident, *args))
        handed[0] = 1
        return (_rebuild, (owner.base, *args))


def shared_batch(batch: dict[str, np.ndarray], payload: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a :class:`SharedBatch` when its payload views a shared buffer, else as is."""
    array = batch[payload]
    owner = array.base
    if isinstance(owner, np.ndarray) and isinstance(owner.base, torch.Tensor) and owner.base.is_shared():
        return SharedBatch(tensors, payload, array)
    return tensors

