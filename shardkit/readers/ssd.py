"""The SSD tier: a run's private directory of reservoirs, and writing one reservoir.

Each run gets ``<ssd_dir>/shardkit-ssd-<pid>-<random>/`` holding a ``lock`` file locked with
``fcntl.flock(LOCK_EX)`` for the run's lifetime. The kernel drops a flock when its holder dies
(even by SIGKILL), so at start-up a sibling ``shardkit-ssd-*`` directory whose lock can be taken
without blocking belongs to a dead run and is deleted, while one whose lock is held belongs to a
live run (another process, or another sampler in this one) and is left alone. The directory is
created under a hidden name and renamed only once its lock is held, so a scanner never sees a live
directory without its lock.

Reservoirs hold the user's data, and ``ssd_dir`` is often a shared directory such as ``/tmp``, so
the run directory is private: ``0700``, and every directory and file in it ``0700`` / ``0600``. The
clean-up of dead runs' directories is equally careful, because anyone can plant a name in a shared
directory: it never follows a symbolic link (a planted ``shardkit-ssd-x -> /somewhere`` is left
alone, and nothing is created or deleted behind it), only touches directories owned by the current
user, and deletes the contents through a descriptor of the directory it checked.

The reservoirs themselves are two scratch files in this directory, rewritten in place (see
:mod:`shardkit.readers.scratch`).
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
from pathlib import Path

from shardkit.errors import ConfigError, SamplerError

__all__ = ["SsdSpace", "PREFIX", "remove_stale", "READ_CHUNK_BYTES", "DIR_MODE", "FILE_MODE"]

logger = logging.getLogger(__name__)

#: Name prefix of a run's private directory.
PREFIX = "shardkit-ssd-"
LOCK_NAME = "lock"
#: Permissions of every directory and file of the SSD tier: the owner's alone.
DIR_MODE = 0o700
FILE_MODE = 0o600
#: Disk -> SSD copies go through a reusable buffer of at most this size (two halves: one is read
#: while the other is written), so memory stays bounded whatever the reservoir size; 32 MiB a half
#: is ~15 ms of sequential reading, long enough to amortise a request, small next to the RAM tier.
READ_CHUNK_BYTES = 64 << 20


def _lock(path: str | os.PathLike[str], *, dir_fd: int | None = None, create: bool = False) -> int | None:
    """Open ``path`` (never through a symlink) and lock it exclusively without blocking.

    Returns the descriptor, or None if it does not exist (and ``create`` is false), is not a regular
    file we may open, or another process holds the lock.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, FILE_MODE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale(ssd_dir: Path) -> list[Path]:
    """Delete ``shardkit-ssd-*`` directories under ``ssd_dir`` whose run is dead; return them.

    A candidate is removed only if it is a real directory (not a symlink), owned by the current
    user, and holds a ``lock`` file nobody holds. Its contents are deleted through a descriptor of
    that very directory, so swapping the name for something else in the meantime changes nothing.
    """
    removed: list[Path] = []
    try:
        names = sorted(n for n in os.listdir(ssd_dir) if n.startswith(PREFIX))
    except FileNotFoundError:
        return removed
    me = os.geteuid()
    for name in names:
        d = Path(ssd_dir) / name
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # a symlink, a file, or gone: not ours to touch
        try:
            if os.fstat(dfd).st_uid != me:
                continue  # another user's run directory
            lock = _lock(LOCK_NAME, dir_fd=dfd)
            if lock is None:
                continue  # a live run holds it, or it is not a run directory of ours
            try:
                _clear(dfd)
                try:
                    os.rmdir(d)
                except OSError:
                    pass  # emptied; whatever now sits at that name is not removed
                removed.append(d)
                logger.info("%s: removed the SSD directory of a run that no longer exists", d)
            finally:
                os.close(lock)
        finally:
            os.close(dfd)
    return removed


def _clear(dfd: int) -> None:
    """Delete everything inside the directory open as ``dfd`` (symlinks are unlinked, not followed)."""
    for entry in os.scandir(dfd):
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.name, dir_fd=dfd)
            else:
                os.unlink(entry.name, dir_fd=dfd)
        except OSError:
            logger.debug("could not remove %s of a stale SSD directory", entry.name, exc_info=True)


class SsdSpace:
    """A run's private, locked SSD directory (see module docstring)."""

    def __init__(self, ssd_dir: str | os.PathLike[str]) -> None:
        self.parent = Path(ssd_dir)
        if not self.parent.is_dir():
            raise ConfigError(f"ssd_dir: expected an existing directory, found {str(self.parent)!r}")
        remove_stale(self.parent)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        building = self.parent / f".{name}.creating"
        building.mkdir(mode=DIR_MODE)
        os.chmod(building, DIR_MODE)  # mkdir's mode is filtered by the umask; this is exact
        fd = _lock(building / LOCK_NAME, create=True)
        if fd is None:
            shutil.rmtree(building, ignore_errors=True)
            raise SamplerError(f"{building}: cannot lock a fresh SSD directory")
        self._lock_fd: int | None = fd
        self.path = self.parent / name
        os.rename(building, self.path)
        self._closed = threading.Lock()

    def create_file(self, name: str) -> int:
        """Create ``name`` in the run directory, ``FILE_MODE`` whatever the umask, and return its
        descriptor (read and write). It must not exist; a symlink is never followed."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path / name, flags, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Delete everything and release the lock (idempotent)."""
        with self._closed:
            if self._lock_fd is None:
                return
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None
