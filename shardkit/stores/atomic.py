"""Files that appear whole or not at all, and a full disk that says which file it stopped.

A file is written to ``<name>.partial``, fsynced and renamed over ``<name>`` (then the directory is
fsynced); any failure removes the ``.partial``, and a full disk or quota is an
:class:`~shardkit.errors.OutOfSpaceError` naming the file.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from shardkit.errors import OutOfSpaceError

__all__ = ["fsync_dir", "write_bytes_atomic", "atomic_file", "raise_out_of_space", "is_out_of_space",
           "start_writeback"]

_FULL = (errno.ENOSPC, errno.EDQUOT)
#: ``SYNC_FILE_RANGE_WRITE`` of Linux's ``sync_file_range``: start writing the range's dirty pages, do not wait.
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range``, or ``None`` where there is none (not Linux, not glibc-like)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to the device now, without
    waiting for it: the file's fsync at its close then waits only for what was written since, instead
    of for the whole file (the dirty pages of a large shard otherwise sit in memory until that fsync,
    which then stalls the end of a conversion). A hint only: nothing happens where the call is missing
    or refused."""
    if _SYNC_RANGE is not None and nbytes > 0:
        _SYNC_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # an error (ESPIPE, EINVAL, ...) leaves it to fsync


def is_out_of_space(exc: BaseException) -> bool:
    """True for the OSError of a full disk or an exhausted quota."""
    return isinstance(exc, OSError) and not isinstance(exc, OutOfSpaceError) and exc.errno in _FULL


def raise_out_of_space(path: Path | str, doing: str) -> NoReturn:
    """Raise the OutOfSpaceError for ``path`` (call from an ``except OSError`` that matched)."""
    raise OutOfSpaceError(f"{path}: no space left on device while {doing}") from None


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, *, durable: bool = True, doing: str = "writing") -> Iterator[int]:
    """A descriptor of ``path.partial``; on a clean exit it is fsynced (``durable``) and renamed over
    ``path`` (and the directory fsynced), on any failure removed. A full disk raises OutOfSpaceError
    naming ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            yield fd
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(exc):
            raise_out_of_space(path, doing)
        raise
    if durable:
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """:func:`atomic_file` holding ``data``; ``durable=False`` skips the fsyncs (scratch data), not the rename."""
    with atomic_file(path, durable=durable) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
