"""The shared-memory ring: ``slots`` payload slots of ``K`` records, then ``slots`` key arrays.

The file ``ring`` of the private run directory (on ``/dev/shm`` by default), so no global name and
no resource tracker that would unlink it when a job exits; its size is reserved at creation, so a
full ``/dev/shm`` fails at start rather than with ``SIGBUS`` mid-epoch.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.errors import OutOfSpaceError, SamplerError
from shardkit.serve.rundir import RunDir
from shardkit.units import human_bytes

__all__ = ["RingLayout", "Ring"]

logger = logging.getLogger(__name__)

_ALIGN = 64
_NAME = "ring"


@dataclass(frozen=True)
class RingLayout:
    """Geometry of the ring; server and job each compute it from the dataset and ``info.json``."""

    slots: int
    slot_records: int
    record_shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def record_nbytes(self) -> int:
        return int(np.prod(self.record_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def keys_offset(self) -> int:
        payload = self.slots * self.slot_records * self.record_nbytes
        return -(-payload // _ALIGN) * _ALIGN

    @property
    def nbytes(self) -> int:
        return self.keys_offset + self.slots * self.slot_records * 8


class Ring:
    """A mapped ring: ``payload[slot]`` (``K`` records) and ``keys[slot]`` (their ``K`` int64 keys)."""

    def __init__(self, layout: RingLayout, mm: mmap.mmap) -> None:
        self.layout = layout
        self._mm = mm
        s, k = layout.slots, layout.slot_records
        self.payload: np.ndarray = np.ndarray((s, k, *layout.record_shape), dtype=layout.dtype, buffer=mm, offset=0)
        self.keys: np.ndarray = np.ndarray((s, k), dtype=np.int64, buffer=mm, offset=layout.keys_offset)

    @classmethod
    def create(cls, rundir: RunDir, layout: RingLayout) -> Ring:
        """Create and reserve the ring in ``rundir`` (the server)."""
        fd = rundir.open_file(_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            try:
                os.posix_fallocate(fd, 0, layout.nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    rundir.unlink(_NAME)
                    raise OutOfSpaceError(
                        f"{rundir.path / _NAME}: cannot reserve {human_bytes(layout.nbytes)} for the shared ring "
                        f"({exc.strerror}); lower the ring size (ram_size) or free {rundir.path.parent}"
                    ) from None
                os.ftruncate(fd, layout.nbytes)
            mm = mmap.mmap(fd, layout.nbytes)
        finally:
            os.close(fd)
        return cls(layout, mm)

    @classmethod
    def attach(cls, rundir: RunDir, layout: RingLayout) -> Ring:
        """Map the server's ring read-only (a job only copies out of it); its size must be what ``layout`` says."""
        fd = rundir.open_file(_NAME, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != layout.nbytes:
                raise SamplerError(
                    f"{rundir.path / _NAME}: {size} bytes, expected {layout.nbytes} for {layout.slots} slots of "
                    f"{layout.slot_records} records of {layout.record_nbytes} bytes; refusing to attach"
                )
            mm = mmap.mmap(fd, layout.nbytes, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return cls(layout, mm)

    def close(self) -> None:
        """Unmap (idempotent). The views must be gone: batches are copies, never views of the ring."""
        self.payload = self.keys = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view escaped (it should not): leave the mapping to the GC
            logger.debug("ring still referenced; not unmapped", exc_info=True)
