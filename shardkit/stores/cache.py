"""A local cache of remote shards for repeated epochs, shared safely by the processes of one machine.

Copies are checked before they get their final name; a copy being filled carries a progress map
that every process of the machine reads, so records are served as soon as their bytes are local.
Layout, locking, eviction and budget: docs/design.md §9 (*Shard cache*).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import secrets
import select
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from shardkit.errors import ConfigError
from shardkit.privdir import PrivateDir
from shardkit.processes import pid_alive, renew_locks_after_fork
from shardkit.stores.atomic import is_out_of_space

__all__ = ["ShardCache", "AskListener", "cache_namespace", "STALE_SECONDS", "PAGE_BYTES", "LAST_PRIORITY", "map_pages", "cache_root",
           "cached_bytes", "footprint", "filler_alive"]

logger = logging.getLogger(__name__)

#: A copy being filled that nobody wrote to for this long belongs to a dead run and is removed (a
#: download gives up after ``StoreOptions.retry_seconds``, 2 min, without progress).
STALE_SECONDS = 600.0
_PART = ".part"
_MAP = "map-"
#: At the cache root: bumped by a process that asked a filler for pages (:meth:`ShardCache.ask`), so
#: fillers look at their maps as soon as it changes instead of on a timer (docs/design.md §9).
_ASKS = "asks"
_ASK_SERIAL = itertools.count()
#: At the cache root: the directory of the fillers' wake-up FIFOs (``wake-<pid>-<token>``, one per
#: listening filler, :meth:`ShardCache.listen`), each written one byte by every :meth:`ShardCache.ask`.
_WAKE_DIR = "wake"
_WAKE = "wake-"
#: A listener's wake-ups read at once: a FIFO's default capacity, so one read empties it.
_WAKE_DRAIN_BYTES = 1 << 16

#: Granularity of a partial copy's progress map: a page of the shard is present (written, readable
#: by every process) or not. 64 KiB keeps a 256 MiB shard's map at 4 KiB and the bytes a record
#: read rounds up to at most two pages beyond it (docs/design.md §9).
PAGE_BYTES = 64 << 10
#: Priorities of asked-for pages (:meth:`ShardCache.want`) run from 0, served first, to this, served
#: last: a reader's first block asks at its turn among the node's consumers (a DataLoader worker's
#: index: the main process takes the workers' first batches in that order), every later block at
#: this (docs/design.md §9, *Shard cache*).
LAST_PRIORITY = 254

#: Complete copies this process already checked, by (device, inode) -> (size, mtime): every pass
#: builds a new :class:`ShardCache`, so without it every pass of every worker read each copy again to
#: check it. Recency is kept in the access time, so a copy's mtime changes only when its bytes are
#: written (a replaced copy is a new inode); such a copy is checked again. Forked workers inherit it.
_VERIFIED: dict[tuple[int, int], tuple[int, int]] = {}
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 1 << 16
renew_locks_after_fork(sys.modules[__name__], "_VERIFIED_LOCK")

#: Extended attribute of a complete copy that a process of this boot checked (or filled and
#: checked): ``<boot id> <size> <mtime_ns>``. The other processes of the machine (DataLoader
#: workers, ranks, the next run) trust it instead of reading the copy again to check it: a copy
#: torn by a crash comes with a new boot, one rewritten in place with a new mtime (docs/design.md §9).
_CHECKED_XATTR = "user.shardkit.checked"
_BOOT_ID: bytes | None = None


def _boot_id() -> bytes:
    """This boot of the machine (``b""`` where unknown: then no copy is trusted by its attribute)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                _BOOT_ID = f.read().strip()
        except OSError:
            _BOOT_ID = b""
    return _BOOT_ID


def _copy_identity(fd: int) -> tuple[tuple[int, int], tuple[int, int]]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns)


def _touch(fd: int) -> None:
    """Mark a complete copy used now (LRU recency, in its access time) without changing its mtime."""
    st = os.fstat(fd)
    os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))


def _checked_mark(size: tuple[int, int]) -> bytes | None:
    """The value of :data:`_CHECKED_XATTR` for a copy of ``(size, mtime_ns)`` checked in this boot."""
    boot = _boot_id()
    return boot + b" %d %d" % size if boot else None


def _checked_before(fd: int) -> bool:
    """Was the complete copy ``fd`` checked as it is now, by this process or by one of this boot?"""
    key, size = _copy_identity(fd)
    with _VERIFIED_LOCK:
        if _VERIFIED.get(key) == size:
            return True
    mark = _checked_mark(size)
    try:
        found = os.getxattr(fd, _CHECKED_XATTR)
    except OSError:  # none, or a file system without user attributes
        return False
    if mark is None or found != mark:
        return False
    _remember(key, size)
    return True


def _remember(key: tuple[int, int], size: tuple[int, int]) -> None:
    with _VERIFIED_LOCK:
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.clear()  # a bound, not a cache policy: the copies are simply checked again
        _VERIFIED[key] = size


def _remember_checked(fd: int) -> None:
    """Record that the complete copy ``fd`` passed its check: in this process, and on the copy for
    the other processes of this boot (where the file system keeps user attributes)."""
    key, size = _copy_identity(fd)
    _remember(key, size)
    mark = _checked_mark(size)
    if mark is not None:
        with suppress(OSError):
            os.setxattr(fd, _CHECKED_XATTR, mark)


def map_pages(size: int) -> int:
    """Pages of a ``size``-byte copy (at least one)."""
    return max(1, -(-size // PAGE_BYTES))


def cache_root(directory: str | os.PathLike[str]) -> Path:
    """The cache root of this user under ``directory``: what to remove to free the cache."""
    return Path(directory) / f"shardkit-cache-{os.geteuid()}"


def cached_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of the copies already in the cache root under ``directory`` (they count towards its
    budget, not against free space); 0 when there is none yet. Unlike the budget's own walk
    (:meth:`ShardCache._entries`, under the cache lock), a namespace that cannot be read is skipped."""
    total = 0
    try:
        namespaces = list(os.scandir(cache_root(directory)))
    except OSError:
        return 0
    for ns in namespaces:
        if not ns.is_dir(follow_symlinks=False):
            continue
        try:
            for entry in os.scandir(ns.path):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def footprint(size: int) -> int:
    """Bytes a copy of a ``size``-byte shard takes from the budget: the copy and, while it is being
    filled, its progress map."""
    return size + 2 * map_pages(size)


def filler_alive(fd: int) -> bool:
    """Whether some open file of the partial copy ``fd`` refers to holds its lock: the process that
    claimed it is alive (the kernel drops the lock of a dead process). ``fd`` must not be the filler's."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _allocate(fd: int, size: int) -> None:
    """Allocate a new copy's blocks at once, so a copy that does not fit fails here (out of space,
    before any byte is fetched) and its parts' writes do not allocate: writes into a sparse file cost
    several times the CPU of writes into allocated space (docs/design.md §9). A file system without
    ``fallocate`` keeps the sparse file."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if is_out_of_space(exc):
            raise
        logger.debug("cache: no fallocate here (%s); the copy stays sparse", exc)


_ADVICE = "Remove it, or choose another cache_dir"


def cache_namespace(url: str, fingerprint: str) -> str:
    """The directory name of one dataset version: a hash of its URL and root-document fingerprint,
    so a replaced dataset never reads another version's bytes."""
    return hashlib.sha256(f"{url}\0{fingerprint}".encode()).hexdigest()[:32]


class AskListener:
    """The read end of one filler's wake-up FIFO (:meth:`ShardCache.listen`): readable once another
    process of the machine asked (:meth:`ShardCache.ask`), so a filler's watcher sleeps until then.

    Its descriptors are released once (:meth:`close`, any thread, any number of times) and forgotten
    under its lock at that moment: a later wake-up, wait or close never reaches a number the process
    has opened again since (an HTTP connection, which a stray byte would corrupt). A child forked
    from this process closes its own inherited copies and forgets them: it never writes, closes or
    removes its parent's FIFO."""

    def __init__(self, folder: PrivateDir, name: str, fd: int) -> None:
        self.name = name
        self._folder: PrivateDir | None = folder
        self._fd: int | None = fd
        self._lock = threading.Lock()
        _LISTENERS.add(self)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def wait(self, timeout: float) -> bool:
        """Sleep until the FIFO has bytes (asks, or :meth:`wake`) or ``timeout`` seconds pass, then
        read them all (many asks meanwhile make one wake-up); False once closed or unusable."""
        fd = self._fd
        if fd is None:
            return False
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(timeout * 1000):
                return True
        except OSError:
            return False
        with self._lock:  # read only while the number is still this FIFO's
            if self._fd != fd:
                return False
            with suppress(BlockingIOError):
                os.read(fd, _WAKE_DRAIN_BYTES)  # one bounded read, even while another process keeps writing
        return True

    def wake(self) -> None:
        """End a :meth:`wait` now (one byte into its own FIFO); nothing once closed."""
        with self._lock:
            if self._fd is not None:
                with suppress(OSError):  # full: it has a wake-up to read already
                    os.write(self._fd, b"\0")

    def close(self) -> None:
        """Remove the FIFO and close its descriptors, the first time only."""
        with self._lock:
            fd, folder, self._fd, self._folder = self._fd, self._folder, None, None
            if fd is None or folder is None:
                return
            try:
                with suppress(OSError):
                    os.unlink(self.name, dir_fd=folder.fd)
                os.close(fd)
            finally:
                folder.close()

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited copies (the parent's stay open) and forget them."""
        self._lock = threading.Lock()
        fd, folder, self._fd, self._folder = self._fd, self._folder, None, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)
        if folder is not None:
            folder.close()


#: Every open :class:`AskListener` of this process, for a forked child to forget.
_LISTENERS: weakref.WeakSet[AskListener] = weakref.WeakSet()


def _forget_listeners_in_child() -> None:
    for listener in list(_LISTENERS):
        listener._forget_in_child()


os.register_at_fork(after_in_child=_forget_listeners_in_child)


class ShardCache:
    """The cache of one dataset version: ``namespace`` (:func:`cache_namespace`) in
    ``<directory>/shardkit-cache-<uid>``, whose whole content may hold ``budget`` bytes (``None``: no limit)."""

    def __init__(self, directory: str | os.PathLike[str], namespace: str, budget: int | None = None) -> None:
        parent = Path(directory)
        if not parent.is_dir():
            raise ConfigError(f"cache_dir: expected an existing directory, found {str(parent)!r}")
        if budget is not None and budget < 0:
            raise ConfigError(f"cache_size: expected a non-negative size, found {budget}")
        self.root = cache_root(parent)
        self.budget = budget
        self._root = PrivateDir.create(self.root, what="the cache directory", advice=_ADVICE, tighten=True)
        self.dir = self.root / namespace
        self._ns = self._root.subdir(namespace, what="the cache directory", advice=_ADVICE, tighten=True)
        self._locked = self._root.mutex()
        self._used: set[str] = set()  # copies this instance opened (their recency was touched)
        self._refused: set[str] = set()
        self._verified: set[str] = set()
        self._fds: dict[str, int] = {}
        self._asks_fd = self._root.open_file(_ASKS, os.O_RDWR | os.O_CREAT)
        self._wakes = self._wake_dir()  # the fillers' wake-up FIFOs (None: asks wake none)
        self._listening: set[str] = set()  # the names of this instance's FIFOs (not woken by its asks)
        self.hits = 0

    # ------------------------------------------------------------------ reading
    def open(self, name: str, verify: Callable[[int], bool]) -> int | None:
        """A descriptor of the complete copy ``name`` (kept open until :meth:`close`), or None.

        A copy that neither this process nor another of this boot completed or checked as it is now
        is checked with ``verify`` on first use; one that fails is dropped (then read remotely).
        """
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        if name in self._refused:
            return None
        try:
            fd = self._ns.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if name not in self._verified and not _checked_before(fd):
            if not verify(fd):
                os.close(fd)
                with self._locked:
                    self._ns.unlink(name)
                logger.warning("%s: the cached copy of %s no longer matches its checksums; dropped", self.dir, name)
                return None
            _remember_checked(fd)
        if name not in self._used:
            self._used.add(name)
            _touch(fd)  # recency for LRU eviction
        self._fds[name] = fd
        self.hits += 1
        return fd

    # ------------------------------------------------------------------ filling
    def claim(self, name: str, size: int) -> int | None:
        """A writable descriptor of a new ``<name>.part`` (its ``size`` reserved in the budget) that
        this instance alone fills, or None: the copy is complete, being filled, or over the budget.

        Next to it, ``map-<name>`` is the copy's progress map (:meth:`open_map`): :func:`map_pages`
        bytes, one per page, set to 1 once the page is written (:meth:`mark_present`), then as many
        bytes other processes set to ask for pages first (:meth:`want`). The descriptor holds an
        ``flock`` until :meth:`complete` or :meth:`abandon`: a copy whose lock is free, or that saw
        no write for :data:`STALE_SECONDS`, belongs to a dead filler and is removed here.
        """
        if name in self._refused:
            return None
        part = name + _PART
        with self._locked:
            if self._ns.exists(name):
                return None
            try:
                st = os.stat(part, dir_fd=self._ns.fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if time.time() - st.st_mtime < STALE_SECONDS and self._filled_by_someone(part):
                    return None  # someone is filling it
                resumed = self._resume(name, size)
                if resumed is not None:
                    logger.info("%s: %s was left by a filler that stopped or died; resumed", self.dir, part)
                    return resumed
                self._ns.unlink(part)  # its writer died
            self._ns.unlink(_MAP + name)  # left by a filler that died before its copy existed
            if not self._admit(footprint(size)):
                self._refused.add(name)
                logger.info("%s: cache full (budget %s bytes); %s stays remote", self.dir, self.budget, name)
                return None
            fd = self._ns.create_file(part)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
                os.ftruncate(fd, size)
                _allocate(fd, size)
                mfd = self._ns.create_file(_MAP + name)
                try:
                    os.ftruncate(mfd, 2 * map_pages(size))
                finally:
                    os.close(mfd)
            except OSError:
                os.close(fd)
                self._ns.unlink(part)
                self._ns.unlink(_MAP + name)
                raise
        return fd

    def _resume(self, name: str, size: int) -> int | None:
        """The filler's descriptor of a copy another filler left (closed, or died): kept when it has
        the right size and a progress map (its present pages were written before they were marked),
        else None (under the lock)."""
        try:
            fd = self._ns.open_file(name + _PART, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mst = os.stat(_MAP + name, dir_fd=self._ns.fd, follow_symlinks=False)
            ok = os.fstat(fd).st_size == size and mst.st_size == 2 * map_pages(size)
        except OSError:  # locked after all, or no map (FileNotFoundError)
            ok = False
        if not ok:
            os.close(fd)
            return None
        os.utime(fd)  # fresh again: a live filler
        return fd

    def _filled_by_someone(self, part: str) -> bool:
        try:
            fd = self._ns.open_file(part, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return filler_alive(fd)
        finally:
            os.close(fd)

    def open_partial(self, name: str) -> tuple[int, int] | None:
        """Descriptors of the copy ``name`` being filled and of its progress map (read-write: see
        :meth:`want`), or None. Both stay valid when the copy completes or is abandoned."""
        try:
            fd = self._ns.open_file(name + _PART, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return fd, self._ns.open_file(_MAP + name, os.O_RDWR)
        except FileNotFoundError:
            os.close(fd)
            return None

    def open_map(self, name: str) -> int:
        """A read-write descriptor of the progress map of the copy ``name`` this instance claimed."""
        return self._ns.open_file(_MAP + name, os.O_RDWR)

    def refused(self, name: str) -> bool:
        """``name`` stays remote in this instance (over the budget, out of space, or replaced)."""
        return name in self._refused

    @staticmethod
    def present(map_fd: int, size: int) -> bytes:
        """The present flags of the pages of a copy of ``size`` bytes, from its map."""
        return os.pread(map_fd, map_pages(size), 0).ljust(map_pages(size), b"\0")

    @staticmethod
    def mark_present(map_fd: int, lo: int, hi: int) -> None:
        """Pages ``lo:hi`` of the copy (already written) are present."""
        os.pwrite(map_fd, b"\1" * (hi - lo), lo)

    @staticmethod
    def want(map_fd: int, size: int, lo: int, hi: int, priority: int = 0) -> None:
        """Ask the filler of the copy for pages ``lo:hi`` first (any process may), at ``priority``
        (0 is served first, at most :data:`LAST_PRIORITY`): each page's byte is ``1 + priority``."""
        os.pwrite(map_fd, bytes([1 + min(max(priority, 0), LAST_PRIORITY)]) * (hi - lo), map_pages(size) + lo)

    @staticmethod
    def wanted(map_fd: int, size: int) -> bytes:
        """The pages other processes asked for (see :meth:`want`): 0 for a page nobody asked for,
        else ``1 + `` the priority it was asked at."""
        n = map_pages(size)
        return os.pread(map_fd, n, n).ljust(n, b"\0")

    def ask(self) -> None:
        """Tell the fillers of this machine that pages were asked for (after :meth:`want`): writes a
        value no other ask wrote (this process's id and a serial) into the root's ``asks`` file, then
        wakes every other listening filler (:meth:`listen`)."""
        os.pwrite(self._asks_fd, struct.pack("<IQ", os.getpid() & 0xFFFFFFFF, next(_ASK_SERIAL)), 0)
        if self._wakes is not None:
            self._wake_listeners(self._wakes)

    def listen(self) -> AskListener | None:
        """A new wake-up FIFO in the cache's ``wake`` directory, readable once another instance asks
        (its owner closes it); None where none can be made (the caller polls :meth:`asked`). Made
        under a hidden name and opened before it is renamed, so an asker never finds it without a
        reader (which it takes for a dead filler's and removes)."""
        folder = self._wake_dir()
        if folder is None:
            return None
        name = f"{_WAKE}{os.getpid()}-{secrets.token_hex(4)}"
        hidden = "." + name
        try:
            os.mkfifo(hidden, 0o600, dir_fd=folder.fd)
            fd = folder.open_file(hidden, os.O_RDWR | os.O_NONBLOCK, kind=stat.S_ISFIFO)
            try:
                os.rename(hidden, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:  # InsecurePathError included
            logger.debug("%s: no wake-up FIFO (%s); the filler polls the ask counter", self.root, exc)
            with suppress(OSError):
                os.unlink(hidden, dir_fd=folder.fd)
            folder.close()
            return None
        self._listening.add(name)
        return AskListener(folder, name, fd)

    def _wake_dir(self) -> PrivateDir | None:
        """The ``wake`` directory opened (created if need be), or None where it cannot be."""
        try:
            return self._root.subdir(_WAKE_DIR, what="the cache's wake-up directory", advice=_ADVICE, tighten=True)
        except OSError as exc:  # InsecurePathError included
            logger.debug("%s: no wake-up directory (%s); fillers poll the ask counter", self.root, exc)
            return None

    def _wake_listeners(self, folder: PrivateDir) -> None:
        """One byte into every other filler's FIFO, never blocking: a full FIFO already holds a
        wake-up; one without a reader is a dead filler's, removed here, as is a hidden one that a
        dead process was making."""
        try:
            names = os.listdir(folder.fd)
        except OSError:
            return
        for name in names:
            if name.startswith(_WAKE) and name not in self._listening:
                _wake_one(folder, name)
            elif name.startswith("." + _WAKE) and not pid_alive(_pid_of(name[1:])):
                with suppress(OSError):
                    os.unlink(name, dir_fd=folder.fd)

    def asked(self) -> bytes:
        """The last ask's value (:meth:`ask`): a filler looks at its maps again when it changes."""
        return os.pread(self._asks_fd, 12, 0)

    def complete(self, name: str, fd: int, size: int, verify: Callable[[int], bool]) -> bool:
        """Finish a copy :meth:`claim` started and close ``fd``: renamed to ``name`` if it has ``size``
        bytes and passes ``verify(fd)`` (True), else deleted (False); its map is deleted.

        Not flushed to the disk (no ``fsync``): a copy is a cache, and a complete copy is checked
        before its first use after each restart of the machine (:meth:`open`, :data:`_CHECKED_XATTR`),
        so one a crash left short or zeroed is dropped and fetched again, never served; a flush would
        only hold the download up (docs/design.md §9)."""
        part = name + _PART
        try:
            ok = os.fstat(fd).st_size == size and verify(fd)
            with self._locked:  # renamed while the lock is held: a claim never sees it abandoned
                if ok:
                    # Marked checked before it gets its name: a reader of this process or another
                    # that opens it the moment it appears does not read it back to check it again.
                    _remember_checked(fd)
                    self._verified.add(name)
                    try:
                        os.rename(part, name, src_dir_fd=self._ns.fd, dst_dir_fd=self._ns.fd)
                    except BaseException:
                        self._verified.discard(name)
                        raise
                    self._used.add(name)
                else:
                    self._ns.unlink(part)
                self._ns.unlink(_MAP + name)
        finally:
            os.close(fd)
        if ok:
            logger.info("%s: cached %s (%d bytes, checksums verified)", self.dir, name, size)
        return ok

    def refuse(self, name: str) -> None:
        """Keep ``name`` remote from now on in this instance (e.g. the disk is full)."""
        self._refused.add(name)

    def release(self, fd: int) -> None:
        """Stop filling a copy :meth:`claim` started, keeping it for the next filler to resume."""
        os.close(fd)

    def abandon(self, name: str, fd: int) -> None:
        """Give up a copy :meth:`claim` started (a failed or cancelled download): close and delete it."""
        try:
            with self._locked:
                self._ns.unlink(name + _PART)
                self._ns.unlink(_MAP + name)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ bookkeeping (under the lock)
    def _admit(self, size: int) -> bool:
        """Make room for ``size`` more bytes (see the module docstring); True if they fit."""
        if self.budget is None:
            return True
        entries = self._entries()
        used = sum(e[2] for e in entries)
        if used + size <= self.budget:
            return True
        here = str(self.dir) + os.sep
        for mtime, path, nbytes, complete in sorted(entries):
            if used + size <= self.budget:
                break
            if not complete and time.time() - mtime < STALE_SECONDS:
                continue  # someone is filling it
            if complete and path.startswith(here):
                continue  # a shard of this very dataset version: evicting it would only thrash
            with suppress(FileNotFoundError):
                os.unlink(path)
                used -= nbytes
                logger.info("cache: evicted %s (%d bytes)", path, nbytes)
        return used + size <= self.budget

    def _entries(self) -> list[tuple[float, str, int, bool]]:
        """``(last use, path, bytes, complete)`` of every copy in the whole cache root (all datasets)."""
        out: list[tuple[float, str, int, bool]] = []
        for ns in os.scandir(self._root.fd):
            if not ns.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(os.path.join(str(self.root), ns.name)):
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                # A partial copy reserves its whole (sparse) size: st_size is the shard's size.
                done = not entry.name.endswith(_PART) and not entry.name.startswith(_MAP)
                # Recency: a complete copy's use is its access time (see _touch), a partial's its last write.
                out.append((max(st.st_atime, st.st_mtime) if done else st.st_mtime, entry.path, st.st_size, done))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        wakes, self._wakes = self._wakes, None
        if wakes is not None:
            wakes.close()
        if self._asks_fd >= 0:
            os.close(self._asks_fd)
            self._asks_fd = -1
        self._locked.close()
        self._ns.close()
        self._root.close()


def _pid_of(name: str) -> int:
    """The process id in a FIFO's name ``wake-<pid>-<token>`` (0 if it has none)."""
    try:
        return int(name[len(_WAKE):].split("-", 1)[0])
    except ValueError:
        return 0


def _wake_one(folder: PrivateDir, name: str) -> None:
    """One byte into the FIFO ``name`` of ``folder`` without blocking; removed if nobody reads it."""
    try:
        fd = folder.open_file(name, os.O_WRONLY | os.O_NONBLOCK, kind=stat.S_ISFIFO)
    except OSError as exc:  # InsecurePathError included: not a FIFO of this user, left alone
        if exc.errno == errno.ENXIO:  # no reader: its filler died
            with suppress(OSError):
                os.unlink(name, dir_fd=folder.fd)
        return
    try:
        os.write(fd, b"\1")
    except OSError:  # EAGAIN: full, the filler has wake-ups to read
        pass
    finally:
        os.close(fd)
