"""Directories private to this user: created ``0700``, held by descriptor, locked while a run lives.

Every directory of user data under a shared place (``/tmp``, ``/dev/shm``) is a :class:`PrivateDir`,
so a path swapped after the check changes nothing; a ``flock``-held ``lock`` tells live runs from
dead ones (docs/design.md §13).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Self

from shardkit.closing import Closing
from shardkit.errors import InsecurePathError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "LOCK_NAME",
    "PrivateDir",
    "Mutex",
    "create_private",
    "create_run_dir",
    "exists_at",
    "open_private",
    "sweep_stale",
    "unlink_at",
]

logger = logging.getLogger(__name__)

#: The modes of every private directory and file: the owner's alone.
DIR_MODE = 0o700
FILE_MODE = 0o600
#: The liveness lock of a run directory.
LOCK_NAME = "lock"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def exists_at(name: str, dir_fd: int) -> bool:
    """Whether ``name`` is in the directory ``dir_fd`` (a symlink counts as itself: it is never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def unlink_at(name: str, dir_fd: int) -> bool:
    """Remove ``name`` from the directory ``dir_fd`` (a symlink itself, never its target); ``False`` if it
    was not there (another process removed it first: an ordinary outcome)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _check_file(where: str, st: os.stat_result, kind: Callable[[int], bool]) -> None:
    """``st`` is of the expected kind, owned by this user, without group/other permissions."""
    if not kind(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise InsecurePathError(
            f"{where}: expected a private file of uid {os.geteuid()} (mode 0o600), found uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):#o}; refusing to use it"
        )


def open_private(
    dir_fd: int, name: str, flags: int, *, where: Path | None = None, kind: Callable[[int], bool] = stat.S_ISREG
) -> int:
    """``os.open`` of ``name`` in the directory ``dir_fd`` (whose path ``where`` names it in messages),
    never through a symlink, checked private (:class:`~shardkit.errors.InsecurePathError` otherwise).
    A file created here is exactly ``0600`` whatever the umask; an existing one is only checked."""
    if flags & os.O_CREAT and not flags & os.O_EXCL:
        existing = flags & ~os.O_CREAT
        while True:  # each turn means another process created or deleted the file meanwhile
            with suppress(FileNotFoundError):
                return open_private(dir_fd, name, existing, where=where, kind=kind)
            with suppress(FileExistsError):
                return open_private(dir_fd, name, flags | os.O_EXCL, where=where, kind=kind)
    shown = str(where / name) if where is not None else name
    try:
        fd = os.open(name, flags | _NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InsecurePathError(f"{shown}: is a symlink; refusing to follow it") from None
        raise
    try:
        if flags & os.O_EXCL:
            os.fchmod(fd, FILE_MODE)  # created here: the umask may have dropped the owner's bits
        _check_file(shown, os.fstat(fd), kind)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(dir_fd: int, name: str) -> int:
    """Create ``name`` (it must not exist) in the directory ``dir_fd``, mode ``0600``, open for reading and writing."""
    return open_private(dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL)


def _try_lock(fd: int, how: int) -> bool:
    """``flock(fd, how)`` without blocking; False if another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class Mutex:
    """An exclusive lock across the processes (``flock``) and the threads (a thread lock: a flock
    does not exclude threads sharing one open file) of a machine; a blocking context manager."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread = threading.Lock()

    def __enter__(self) -> None:
        self._thread.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread.release()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def close(self) -> None:
        """Close the lock file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PrivateDir(Closing):
    """An open, verified private directory; use :meth:`create` or :meth:`open`.

    Refused (:class:`~shardkit.errors.InsecurePathError`) unless a real directory of this user with
    mode ``0700``, then used only through its descriptor. ``what`` names it in refusals (``"the cache
    directory"``), ``advice`` says what to do (``"Remove it, or choose another cache_dir"``).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._alive: int | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        what: str = "a shardkit private directory",
        advice: str = "Remove it",
        tighten: bool = False,
        exclusive: bool = False,
        parent: PrivateDir | None = None,
    ) -> Self:
        """Create ``path`` (mode ``0700``) or take the existing one if it is private.

        ``parent``: ``path`` is a name inside that open private directory. ``tighten``: an existing
        directory of this user with a wider mode is set to ``0700`` instead of refused.
        ``exclusive``: the directory must not exist yet (:class:`FileExistsError`).
        """
        path = Path(path)
        name, dir_fd = (path.name, parent.fd) if parent is not None else (str(path), None)
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
            created = True
        except FileExistsError:
            if exclusive:
                raise
            created = False
        return cls._verified(path, name, dir_fd, what, advice, tighten=created or tighten)

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, what: str = "a shardkit private directory", advice: str = "Remove it"
    ) -> Self:
        """Open an existing private directory (:class:`FileNotFoundError` if there is none)."""
        path = Path(path)
        return cls._verified(path, str(path), None, what, advice, tighten=False)

    def subdir(self, name: str, *, what: str, advice: str, tighten: bool = False) -> PrivateDir:
        """Create or open the private directory ``name`` inside this one (see :meth:`create`)."""
        return PrivateDir.create(self.path / name, parent=self, what=what, advice=advice, tighten=tighten)

    @staticmethod
    def _refusal(path: Path, found: str, what: str, advice: str) -> InsecurePathError:
        return InsecurePathError(
            f"{path}: {found}; {what} must be a directory owned by uid {os.geteuid()} (this user) with mode 0o700. "
            f"Refusing to use it: another user may control it. {advice}"
        )

    @classmethod
    def _verified(cls, path: Path, name: str, dir_fd: int | None, what: str, advice: str, *, tighten: bool) -> Self:
        """Open the directory ``name`` (never through a symlink) and check it; ``tighten`` first sets
        a directory of this user to mode ``0700`` (mkdir's mode is filtered by the umask)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            raise cls._refusal(path, "is a symlink" if link else "is not a directory", what, advice) from None
        try:
            st = os.fstat(fd)
            if tighten and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.fchmod(fd, DIR_MODE)
                st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise cls._refusal(path, f"is owned by uid {st.st_uid}", what, advice)
            if stat.S_IMODE(st.st_mode) != DIR_MODE:
                raise cls._refusal(path, f"has mode {stat.S_IMODE(st.st_mode):#o}", what, advice)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    # ------------------------------------------------------------------ files inside
    def open_file(self, name: str, flags: int, kind: Callable[[int], bool] = stat.S_ISREG) -> int:
        """:func:`open_private` of ``name`` in this directory."""
        return open_private(self.fd, name, flags, where=self.path, kind=kind)

    def create_file(self, name: str) -> int:
        """:func:`create_private` of ``name`` in this directory."""
        return create_private(self.fd, name)

    def check_file(self, name: str, kind: Callable[[int], bool] = stat.S_ISREG) -> None:
        """``name`` is a private entry of this user of the given kind (not followed if a symlink)."""
        _check_file(str(self.path / name), os.stat(name, dir_fd=self.fd, follow_symlinks=False), kind)

    def read_file(self, name: str, limit: int) -> bytes:
        """The bytes of a small private file, refusing one larger than ``limit`` before reading it."""
        with open(self.open_file(name, os.O_RDONLY), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > limit:
                raise InsecurePathError(f"{self.path / name}: {size} bytes, at most {limit} expected; refusing to read it")
            return fh.read(size)

    def write_file(self, name: str, data: bytes) -> None:
        """Replace ``name`` atomically with a private file holding ``data``: ``<name>.partial``, then rename."""
        tmp = f"{name}.partial"
        self.unlink(tmp)
        with open(create_private(self.fd, tmp), "wb") as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        """Whether ``name`` is in the directory (a symlink counts as itself)."""
        return exists_at(name, self.fd)

    def unlink(self, name: str) -> bool:
        """Remove ``name`` (a symlink itself, never its target); False if it was not there."""
        return unlink_at(name, self.fd)

    def clear(self, keep: tuple[str, ...] = (LOCK_NAME,)) -> list[str]:
        """Remove every file but ``keep`` (leftovers of a dead run); return their paths (directories stay)."""
        removed = []
        for entry in sorted(os.listdir(self.fd)):
            if entry in keep:
                continue
            try:
                if self.unlink(entry):
                    removed.append(str(self.path / entry))
            except IsADirectoryError:
                logger.warning("%s: unexpected directory %s left alone", self.path, entry)
        return removed

    def remove(self) -> None:
        """Delete everything inside (through the descriptor; symlinks unlinked, never followed) and the directory."""
        for entry in os.scandir(self.fd):
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.name, dir_fd=self.fd)
                else:
                    self.unlink(entry.name)
            except OSError:
                logger.debug("%s: could not remove %s", self.path, entry.name, exc_info=True)
        with suppress(OSError):  # emptied; whatever now sits at that name is not removed
            os.rmdir(self.path)

    # ------------------------------------------------------------------ locks
    def lock(self, name: str = LOCK_NAME) -> int | None:
        """Take the exclusive lock ``name`` (created if missing) without waiting: its descriptor (held
        until closed), or None if another process holds it."""
        fd = self.open_file(name, os.O_RDWR | os.O_CREAT)
        if not _try_lock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
        return fd

    def lock_is_held(self, name: str = LOCK_NAME) -> bool:
        """True if a live process holds the lock ``name`` (False when there is no such file)."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not _try_lock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

    def mutex(self, name: str = LOCK_NAME) -> Mutex:
        """A :class:`Mutex` on the lock file ``name`` (created if missing), for short critical sections."""
        return Mutex(self.open_file(name, os.O_RDWR | os.O_CREAT))

    def close(self) -> None:
        """Close the descriptor, and release the liveness lock of a run directory (idempotent)."""
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_run_dir(parent: str | os.PathLike[str], prefix: str) -> PrivateDir:
    """A fresh private directory ``<parent>/<prefix><pid>-<random>`` whose ``lock`` this process holds
    until :meth:`PrivateDir.close` (it gets that name only once locked, so :func:`sweep_stale` spares it)."""
    parent = Path(parent)
    name = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    run = PrivateDir.create(parent / f".{name}.creating", exclusive=True)
    try:
        alive = run.lock()
        if alive is None:
            raise InsecurePathError(f"{run.path}: another process took the lock of a directory just created")
        run._alive = alive
        os.rename(run.path, parent / name)
    except BaseException:
        run.remove()
        run.close()
        raise
    run.path = parent / name
    return run


def sweep_stale(parent: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Delete the ``<prefix>*`` directories under ``parent`` whose run is dead (a private directory of
    this user, never a symlink, whose ``lock`` nobody holds), through their checked descriptor; return them."""
    parent = Path(parent)
    removed: list[Path] = []
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except FileNotFoundError:
        return removed
    for name in names:
        try:
            run = PrivateDir.open(parent / name)
        except OSError:
            continue  # a symlink, a file, another user's, or gone: not ours to touch
        with run:
            try:
                lock = open_private(run.fd, LOCK_NAME, os.O_RDWR)
            except OSError:
                continue  # not a run directory of ours
            try:
                if not _try_lock(lock, fcntl.LOCK_EX):
                    continue  # a live run holds it
                run.remove()
                removed.append(run.path)
                logger.info("%s: removed the directory of a run that no longer exists", run.path)
            finally:
                os.close(lock)
    return removed
