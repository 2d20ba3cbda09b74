"""Files that appear whole or not at all, and a full disk that says which file it stopped.

A file is written to ``<name>.partial``, fsynced and renamed over ``<name>`` (then the directory is
fsynced); any failure removes the ``.partial``, and a full disk or quota is an
:class:`~shardkit.errors.OutOfSpaceError` naming the file. Inside :func:`synced_together`, those fsyncs
wait for the end of the block, where they run together. A large file made durable while it is written
(:class:`BackgroundFlush`) leaves its final fsync only the bytes since the last background flush.
"""

from __future__ import annotations

import contextvars
import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from shardkit.errors import OutOfSpaceError

__all__ = ["fsync_dir", "write_bytes_atomic", "atomic_file", "raise_out_of_space", "is_out_of_space",
           "start_writeback", "synced_now", "synced_together", "BackgroundFlush"]

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


class BackgroundFlush:
    """Make the bytes written to ``fd`` durable while the file is still being written: once ``every``
    bytes were written since the last request, a thread fdatasyncs the file; the writer never waits
    for it. A request made while a flush runs is merged into one more flush after it, so at most one
    runs at a time, and the thread ends when none is wanted (no idle thread is left behind for a fork
    to meet).

    Why fdatasync and not only ``start_writeback``: a volatile write cache (a virtual machine's host,
    a drive's own) is emptied by a flush, not by writeback, so the file's fsync at its close would still
    wait for everything written since the last flush. The caller fsyncs the file at its close as before,
    after :meth:`finish`, which waits for a running flush and raises the error a flush met (a failed
    writeback is reported to one fsync only, so it must not be dropped here): OutOfSpaceError for a full
    disk, else the OSError, both naming ``path``.
    """

    def __init__(self, fd: int, path: Path | str, every: int) -> None:
        self.fd = fd
        self.path = path
        self.every = int(every)
        #: Flushes run so far (each covers every byte written before it started).
        self.flushes = 0
        self._pending = 0  # bytes written since the last request
        self._wanted = 0  # requests made, and the highest request a finished flush covered
        self._covered = 0
        self._error: OSError | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def written(self, nbytes: int) -> None:
        """Count ``nbytes`` more written; ask for a flush once ``every`` are. Raises a flush's error."""
        self._raise_error()
        self._pending += nbytes
        if self._pending < self.every:
            return
        self._pending = 0
        with self._lock:
            self._wanted += 1
            if self._thread is not None:  # the running thread flushes again for this request
                return
            self._thread = threading.Thread(target=self._run, name="shardkit-flush", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._covered == self._wanted or self._error is not None:
                    self._thread = None
                    return
                target = self._wanted
            try:
                os.fdatasync(self.fd)
            except OSError as exc:
                with self._lock:
                    self._error = exc
                continue
            with self._lock:
                self.flushes += 1
                self._covered = target

    def finish(self) -> None:
        """Wait for a running flush (no new one starts unless :meth:`written` asks); raise its error."""
        self.finish_quietly()
        self._raise_error()

    def finish_quietly(self) -> None:
        """Wait for a running flush, ignoring its error (the file is being given up)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _raise_error(self) -> None:
        exc = self._error
        if exc is None:
            return
        if is_out_of_space(exc):
            raise_out_of_space(self.path, "flushing (fdatasync)")
        raise OSError(exc.errno, f"{exc.strerror} (flushing in the background)", os.fspath(self.path)) from exc


def is_out_of_space(exc: BaseException) -> bool:
    """True for the OSError of a full disk or an exhausted quota."""
    return isinstance(exc, OSError) and not isinstance(exc, OutOfSpaceError) and exc.errno in _FULL


def raise_out_of_space(path: Path | str, doing: str) -> NoReturn:
    """Raise the OutOfSpaceError for ``path`` (call from an ``except OSError`` that matched)."""
    raise OutOfSpaceError(f"{path}: no space left on device while {doing}") from None


class _Deferred:
    """The files and directories whose fsyncs a :func:`synced_together` block holds back (any thread)."""

    def __init__(self) -> None:
        self.files: dict[str, None] = {}
        self.dirs: dict[str, None] = {}
        self.lock = threading.Lock()

    def sync(self) -> None:
        """Every file's bytes, then every directory: writeback starts for all files before the first
        fsync waits, so one journal commit carries them and the later fsyncs find little left to do."""
        fds = []
        try:
            for path in self.files:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:  # replaced or removed later in the block: its successor is listed
                    continue
                fds.append(fd)
                start_writeback(fd, 0, os.fstat(fd).st_size)
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        for directory in self.dirs:
            if os.path.isdir(directory):
                _fsync_dir_now(Path(directory))


_DEFERRED: contextvars.ContextVar[_Deferred | None] = contextvars.ContextVar("shardkit_deferred_fsyncs", default=None)


@contextmanager
def synced_together() -> Iterator[None]:
    """Hold back the fsyncs of :func:`atomic_file` and :func:`fsync_dir` in this block (this context:
    threads started with :func:`contextvars.copy_context` too) and run them all at its clean end.

    For a sequence of small files that only need to be durable before a later step publishes them (the
    files of a commit before its root document): one fsync each as it is written costs a journal commit
    each, waited for one after the other. Renames still happen at once, so a reader sees each file
    whole; a crash before the end of the block may lose files written in it, which is why nothing may
    refer to them durably until it ended. After a failure nothing is synced (nothing was published).
    """
    outer = _DEFERRED.get()
    if outer is not None:  # nested: the outer block syncs
        yield
        return
    deferred = _Deferred()
    token = _DEFERRED.set(deferred)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
    deferred.sync()


@contextmanager
def synced_now() -> Iterator[None]:
    """Inside a :func:`synced_together` block, a step whose files must be durable before the next
    one starts (a copy kept before its original is replaced): its fsyncs run as it goes."""
    token = _DEFERRED.set(None)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it is durable (at the end of a :func:`synced_together` block)."""
    deferred = _DEFERRED.get()
    if deferred is not None:
        with deferred.lock:
            deferred.dirs[os.fspath(path)] = None
        return
    _fsync_dir_now(path)


def _fsync_dir_now(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, *, durable: bool = True, doing: str = "writing") -> Iterator[int]:
    """A descriptor of ``path.partial``; on a clean exit it is fsynced (``durable``; inside
    :func:`synced_together` at the end of that block) and renamed over ``path`` (and the directory
    fsynced), on any failure removed. A full disk raises OutOfSpaceError
    naming ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    deferred = _DEFERRED.get() if durable else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            yield fd
            if durable and deferred is None:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(exc):
            raise_out_of_space(path, doing)
        raise
    if deferred is not None:
        with deferred.lock:
            deferred.files[os.fspath(path)] = None
    if durable:
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """:func:`atomic_file` holding ``data``; ``durable=False`` skips the fsyncs (scratch data), not the rename."""
    with atomic_file(path, durable=durable) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
