"""Files that appear whole or not at all, and a full disk that says which file it stopped.

A file is written to ``<name>.partial``, fsynced and renamed over ``<name>`` (then the directory is
fsynced); any failure removes the ``.partial``, and a full disk or quota is an
:class:`~shardkit.errors.OutOfSpaceError` naming the file.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from shardkit.errors import OutOfSpaceError

__all__ = ["fsync_dir", "write_bytes_atomic", "atomic_file", "raise_out_of_space", "is_out_of_space"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


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
