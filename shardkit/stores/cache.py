"""A local cache of remote shards for repeated epochs, shared safely by the processes of one machine.

Copies are checked before they get their final name; layout, locking, eviction and budget:
docs/design.md §9 (*Shard cache*).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from shardkit.errors import ConfigError
from shardkit.privdir import PrivateDir

__all__ = ["ShardCache", "cache_namespace", "STALE_SECONDS"]

logger = logging.getLogger(__name__)

#: A copy being filled that nobody wrote to for this long belongs to a dead run and is removed (a
#: download gives up after ``StoreOptions.retry_seconds``, 2 min, without progress).
STALE_SECONDS = 600.0
_PART = ".part"
_ADVICE = "Remove it, or choose another cache_dir"


def cache_namespace(url: str, fingerprint: str) -> str:
    """The directory name of one dataset version: a hash of its URL and root-document fingerprint,
    so a replaced dataset never reads another version's bytes."""
    return hashlib.sha256(f"{url}\0{fingerprint}".encode()).hexdigest()[:32]


class ShardCache:
    """The cache of one dataset version: ``namespace`` (:func:`cache_namespace`) in
    ``<directory>/shardkit-cache-<uid>``, whose whole content may hold ``budget`` bytes (``None``: no limit)."""

    def __init__(self, directory: str | os.PathLike[str], namespace: str, budget: int | None = None) -> None:
        parent = Path(directory)
        if not parent.is_dir():
            raise ConfigError(f"cache_dir: expected an existing directory, found {str(parent)!r}")
        if budget is not None and budget < 0:
            raise ConfigError(f"cache_size: expected a non-negative size, found {budget}")
        self.root = parent / f"shardkit-cache-{os.geteuid()}"
        self.budget = budget
        self._root = PrivateDir.create(self.root, what="the cache directory", advice=_ADVICE, tighten=True)
        self.dir = self.root / namespace
        self._ns = self._root.subdir(namespace, what="the cache directory", advice=_ADVICE, tighten=True)
        self._locked = self._root.mutex()
        self._used: set[str] = set()  # copies this instance opened (their recency was touched)
        self._refused: set[str] = set()
        self._verified: set[str] = set()
        self._fds: dict[str, int] = {}
        self.hits = 0

    # ------------------------------------------------------------------ reading
    def open(self, name: str, verify: Callable[[int], bool]) -> int | None:
        """A descriptor of the complete copy ``name`` (kept open until :meth:`close`), or None.

        A copy this instance did not complete itself is checked with ``verify`` on first use; one
        that fails is dropped (then read remotely).
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
        if name not in self._verified and not verify(fd):
            os.close(fd)
            with self._locked:
                self._ns.unlink(name)
            logger.warning("%s: the cached copy of %s no longer matches its checksums; dropped", self.dir, name)
            return None
        if name not in self._used:
            self._used.add(name)
            os.utime(fd)  # recency for LRU eviction
        self._fds[name] = fd
        self.hits += 1
        return fd

    # ------------------------------------------------------------------ filling
    def claim(self, name: str, size: int) -> int | None:
        """A writable descriptor of a new ``<name>.part`` (its ``size`` reserved in the budget) that
        this instance alone fills, or None: the copy is complete, being filled, or over the budget.
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
                if time.time() - st.st_mtime < STALE_SECONDS:
                    return None  # someone is filling it
                self._ns.unlink(part)  # its writer died
            if not self._admit(size):
                self._refused.add(name)
                logger.info("%s: cache full (budget %s bytes); %s stays remote", self.dir, self.budget, name)
                return None
            fd = self._ns.create_file(part)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                self._ns.unlink(part)
                raise
        return fd

    def complete(self, name: str, fd: int, size: int, verify: Callable[[int], bool]) -> bool:
        """Finish a copy :meth:`claim` started and close ``fd``: renamed to ``name`` if it has ``size``
        bytes and passes ``verify(fd)`` (True), else deleted (False)."""
        part = name + _PART
        try:
            os.fsync(fd)
            ok = os.fstat(fd).st_size == size and verify(fd)
        finally:
            os.close(fd)
        with self._locked:
            if ok:
                os.rename(part, name, src_dir_fd=self._ns.fd, dst_dir_fd=self._ns.fd)
                self._verified.add(name)  # just checked: the first open need not read it again
                self._used.add(name)
            else:
                self._ns.unlink(part)
        if ok:
            logger.info("%s: cached %s (%d bytes, checksums verified)", self.dir, name, size)
        return ok

    def refuse(self, name: str) -> None:
        """Keep ``name`` remote from now on in this instance (e.g. the disk is full)."""
        self._refused.add(name)

    def abandon(self, name: str, fd: int) -> None:
        """Give up a copy :meth:`claim` started (a failed or cancelled download): close and delete it."""
        os.close(fd)
        with self._locked:
            self._ns.unlink(name + _PART)

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
        """``(mtime, path, bytes, complete)`` of every copy in the whole cache root (all datasets)."""
        out: list[tuple[float, str, int, bool]] = []
        for ns in os.scandir(self._root.fd):
            if not ns.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(os.path.join(str(self.root), ns.name)):
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                # A partial copy reserves its whole (sparse) size: st_size is the shard's size.
                out.append((st.st_mtime, entry.path, st.st_size, not entry.name.endswith(_PART)))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._locked.close()
        self._ns.close()
        self._root.close()
