"""A server's run directory: private to its user, checked before anything in it is trusted.

``<base>/shardkit-serve-<uid>-<NAME>/`` (base = ``/dev/shm`` when writable, else the temp dir)
holds the server's ``lock`` (an exclusive ``flock`` for its whole life), its secret ``token``, the
shared-memory ``ring``, the Unix ``sock`` and ``info.json``. Whoever controls that directory
controls what a job maps and whom it talks to, so both sides refuse it unless it is a real
directory (not a symlink), owned by the current user, with mode exactly ``0700``.

Everything is checked on an open descriptor (``O_NOFOLLOW``, then ``fstat``), and every file inside
is opened relative to that descriptor (``dir_fd``, ``O_NOFOLLOW``) and checked the same way (owner,
no group/other permission bits), so a path swapped after the check is never followed. The socket is
reached through ``/proc/self/fd/<fd>/sock`` where Linux offers it, which also keeps the address
short whatever the base directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from shardkit.dirfd import unlink_at
from shardkit.errors import ConfigError, InsecurePathError

__all__ = ["RUN_PREFIX", "check_name", "default_base_dir", "run_dir_path", "RunDir"]

logger = logging.getLogger(__name__)

RUN_PREFIX = "shardkit-serve-"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def check_name(name: str) -> str:
    """A server name: 1-64 of ``[A-Za-z0-9_-]`` (it becomes part of a file name)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"name: expected 1-64 characters of [A-Za-z0-9_-], found {name!r}")
    return name


def default_base_dir() -> Path:
    """Where run directories live: ``/dev/shm`` when writable (RAM, so the ring is shared memory), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def run_dir_path(name: str, base_dir: str | os.PathLike[str] | None = None) -> Path:
    """The run directory of this user's server ``name``."""
    base = Path(base_dir) if base_dir is not None else default_base_dir()
    return base / f"{RUN_PREFIX}{os.geteuid()}-{check_name(name)}"


def _refuse(path: Path | str, found: str) -> InsecurePathError:
    return InsecurePathError(
        f"{path}: {found}; a shardkit run directory must be a directory owned by uid {os.geteuid()} (this user) "
        f"with mode 0o700. Refusing to use it: another user may control it. Remove it, or choose another --name "
        f"or base directory"
    )


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, "is a symlink" if path.is_symlink() else "is not a directory") from None
        raise


def _check_dir(path: Path, fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"is owned by uid {st.st_uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode != _DIR_MODE:
        raise _refuse(path, f"has mode {mode:#o}")


class RunDir:
    """An open, verified run directory (see module docstring); files are reached through its descriptor."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def claim(cls, path: Path) -> RunDir:
        """The server side: create ``path`` (0700) or take the existing one if it is safe."""
        if not path.parent.is_dir():
            raise ConfigError(f"base_dir: expected an existing directory, found {str(path.parent)!r}")
        try:
            os.mkdir(path, _DIR_MODE)
            created = True
        except FileExistsError:
            created = False
        fd = _open_dir(path)
        try:
            if created and os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, _DIR_MODE)  # exactly 0700 whatever the umask
            _check_dir(path, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @classmethod
    def open(cls, path: Path) -> RunDir:
        """The job side: open an existing run directory (FileNotFoundError if there is none)."""
        fd = _open_dir(path)
        try:
            _check_dir(path, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    # ------------------------------------------------------------------ files inside
    def _check(self, name: str, st: os.stat_result, kind: Callable[[int], bool]) -> None:
        if not kind(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise InsecurePathError(
                f"{self.path / name}: expected a private file of uid {os.geteuid()} (mode 0o600), found uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o}; refusing to use it"
            )

    def open_file(self, name: str, flags: int, kind: Callable[[int], bool] = stat.S_ISREG) -> int:
        """``os.open`` of ``name`` inside, never following a symlink, checked private; returns the fd."""
        try:
            fd = os.open(name, flags | _NOFOLLOW, _FILE_MODE, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InsecurePathError(f"{self.path / name}: is a symlink; refusing to follow it") from None
            raise
        try:
            self._check(name, os.fstat(fd), kind)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def check_socket(self, name: str) -> None:
        """``name`` is a private socket of this user (a job checks before it connects)."""
        self._check(name, os.stat(name, dir_fd=self.fd, follow_symlinks=False), stat.S_ISSOCK)

    def read_file(self, name: str, limit: int) -> bytes:
        """The bytes of a small private file, refusing one larger than ``limit`` before reading it."""
        fd = self.open_file(name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise InsecurePathError(f"{self.path / name}: {size} bytes, at most {limit} expected; refusing to read it")
            chunks, total = [], 0
            while total < size and (chunk := os.read(fd, size - total)):
                chunks.append(chunk)
                total += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_file(self, name: str, data: bytes) -> None:
        """Write a private (0600) file atomically: ``name.partial``, then rename."""
        tmp = f"{name}.partial"
        self.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _FILE_MODE, dir_fd=self.fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> bool:
        """Remove ``name`` (a symlink itself, never its target); False if it was not there."""
        return unlink_at(name, self.fd)

    def clear(self, keep: tuple[str, ...] = ("lock",)) -> list[str]:
        """Remove every entry but ``keep`` (leftovers of a dead server); return their paths."""
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

    def address(self, name: str = "sock") -> str:
        """The socket address of ``name``, through this descriptor where the OS allows it."""
        proc = f"/proc/self/fd/{self.fd}"
        return f"{proc}/{name}" if os.path.isdir(proc) else str(self.path / name)

    # ------------------------------------------------------------------ the lock
    def lock(self) -> int | None:
        """Take the exclusive lock (the server's for its life); its fd, or None if someone holds it."""
        fd = self.open_file("lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    def lock_is_held(self) -> bool:
        """True if a live server holds the lock (the kernel drops it when the process dies, even by SIGKILL)."""
        try:
            fd = self.open_file("lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def remove(self) -> None:
        """Delete every file and the directory itself (the server, at exit)."""
        self.clear(keep=())
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
