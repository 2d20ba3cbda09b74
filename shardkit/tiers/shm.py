"""Memory shared by the processes of one machine: private, named regions under ``/dev/shm``, each
created once and mapped by every process (docs/design.md §4 *Node-shared memory*,
and docs/design.md §13)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import random
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.formats import Dataset
from shardkit.formats.mapping import populate, populate_ranges
from shardkit.privdir import PrivateDir, create_private, exists_at, open_private, unlink_at
from shardkit.processes import pid_alive

__all__ = [
    "SharedRegion",
    "attach",
    "region_name",
    "sharing_available",
    "dataset_key",
    "node_fields",
    "node_permutation",
    "remove_stale",
    "SHM_ROOT",
]

logger = logging.getLogger(__name__)

#: Where shared regions live (a tmpfs on Linux).
SHM_ROOT = Path("/dev/shm")
#: How long a process waits for another one to finish creating a region before it gives up and
#: keeps a private copy (a stuck creator must not hang training).
CREATE_TIMEOUT = 600.0
_POLL = 0.01
_populate = [True]

_dir_lock = threading.Lock()
_dir_state: dict[str, object] = {}  # "pid", "fd", "cleaned"
_live: weakref.WeakSet[SharedRegion] = weakref.WeakSet()


def region_name(kind: str, *parts: object) -> str:
    """``<kind>-<hash>``: a name that differs whenever any of ``parts`` differs."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:40]
    return f"{kind}-{digest}"


def _private_dir() -> int | None:
    """A descriptor of ``/dev/shm/shardkit-<uid>`` (created and checked once per process), or None."""
    with _dir_lock:
        if _dir_state.get("pid") == os.getpid():
            fd = _dir_state.get("fd")
            return fd if isinstance(fd, int) else None
        _dir_state.clear()
        _dir_state["pid"] = os.getpid()
        path = SHM_ROOT / f"shardkit-{os.geteuid()}"
        try:
            if not SHM_ROOT.is_dir():
                raise OSError(errno.ENOENT, f"{SHM_ROOT} does not exist")
            private = PrivateDir.create(path, what="the directory of node-shared memory")
        except OSError as exc:  # InsecurePathError included: it says what was found
            logger.warning("node sharing is off: cannot use %s (%s); every process keeps its own copies", path, exc)
            return None
        _dir_state["fd"] = private.fd  # kept open for the process
        return private.fd


def sharing_available() -> bool:
    """Can this process share regions with others on the machine?"""
    return _private_dir() is not None


def _same_file(name: str, dfd: int, fd: int) -> bool:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _remove_stale(dfd: int) -> None:
    """Delete regions nobody holds (their processes died) and creators' leftovers of dead pids."""
    for entry in os.scandir(dfd):
        name = entry.name
        if name.endswith(".tmp") and name.startswith("."):
            pid = name.split(".")[2] if name.count(".") >= 3 else ""
            if pid.isdigit() and not pid_alive(int(pid)):
                unlink_at(name, dfd)
            continue
        if not name.endswith(".lock"):
            continue
        try:
            lfd = open_private(dfd, name, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lfd)
            continue
        try:
            if _same_file(name, dfd, lfd):
                unlink_at(name[: -len(".lock")], dfd)
                unlink_at(name, dfd)
                logger.debug("removed the shared region %s of processes that no longer exist", name[:-5])
        finally:
            os.close(lfd)


def _reserve(fd: int, m: mmap.mmap, offset: int, length: int) -> bool:
    """Allocate (and map) bytes ``[offset, offset + length)`` of a shared region; False if the node
    has no memory for them (``MADV_POPULATE_WRITE`` where the kernel has it, else ``posix_fallocate``),
    where a write through the mapping would be a SIGBUS."""
    if _populate[0]:
        start = offset - offset % mmap.PAGESIZE
        try:
            populate(m, start, offset + length - start)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return False  # EFAULT/ENOMEM: no memory for it
            _populate[0] = False  # not supported here
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError:
        return False
    return True


def _drop_unused_lock(name: str, dfd: int, lfd: int) -> None:
    """After a failed creation: delete ``name.lock`` unless another process uses it; close it."""
    try:
        with suppress(OSError):
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(f"{name}.lock", dfd, lfd) and not exists_at(name, dfd):
                unlink_at(f"{name}.lock", dfd)
    finally:
        os.close(lfd)


class _Unusable(Exception):
    """A region's file exists but may not be used (the caller keeps a private copy)."""


def remove_stale() -> None:
    """Delete the regions of this user whose processes all died (``attach`` does this once per
    process; long-running processes may call it again)."""
    dfd = _private_dir()
    if dfd is not None:
        _remove_stale(dfd)


class SharedRegion:
    """A mapped region of node-shared memory (docs/design.md §4, node-shared memory); use :func:`attach`.
    ``name`` is its file name, ``created`` true in the process that created (and filled) it."""

    def __init__(self, name: str, nbytes: int, mapping: mmap.mmap, lock_fd: int, data_fd: int, created: bool) -> None:
        self.name, self.nbytes, self.created = name, int(nbytes), created
        self._mmap: mmap.mmap | None = mapping
        self._lock_fd: int | None = lock_fd
        self._data_fd: int | None = data_fd
        self._pid = os.getpid()
        self._guard = threading.Lock()
        _live.add(self)

    def array(self, dtype: np.dtype[Any] | type, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A numpy view of the region (read-only unless the region was attached writable)."""
        assert self._mmap is not None, "region already released"
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset).reshape(shape)

    def reserve(self, ranges: list[tuple[int, int]]) -> list[bool]:
        """Allocate the memory of byte ranges ``(offset, length)`` of a writable region before they
        are written; False for a range the node has no memory for (its writer must not write it:
        on a full tmpfs a write through the mapping is a SIGBUS, an allocation here is an error)."""
        fd, m = self._data_fd, self._mmap
        if fd is None or m is None:
            return [False] * len(ranges)
        if _populate[0] and populate_ranges(m, ranges):
            return [True] * len(ranges)
        return [_reserve(fd, m, offset, length) for offset, length in ranges]

    def _forget(self) -> None:
        """In a forked child: the lock descriptors are the parent's; never use them."""
        self._lock_fd = self._data_fd = None

    def release(self) -> None:
        """Let go of the region; the last process on the node deletes it (idempotent). Views that
        still exist keep the mapping valid."""
        with self._guard:
            lfd, dfd_data = self._lock_fd, self._data_fd
            self._lock_fd = self._data_fd = None
            self._mmap = None
        if lfd is None or os.getpid() != self._pid:
            return
        try:
            dfd = _private_dir()
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another process still uses it
            if dfd is not None and _same_file(f"{self.name}.lock", dfd, lfd):
                if dfd_data is not None and _same_file(self.name, dfd, dfd_data):
                    unlink_at(self.name, dfd)
                unlink_at(f"{self.name}.lock", dfd)
        finally:
            os.close(lfd)
            if dfd_data is not None:
                os.close(dfd_data)

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown
            self.release()

    def __repr__(self) -> str:
        return f"SharedRegion({self.name!r}, {self.nbytes} bytes, created={self.created})"


def attach(
    name: str,
    nbytes: int,
    init: Callable[[mmap.mmap], None],
    *,
    writable: bool = False,
    reserve: int | None = None,
    timeout: float = CREATE_TIMEOUT,
) -> SharedRegion | None:
    """Map region ``name`` of ``nbytes`` bytes, creating it with ``init(mapping)`` (in one process per
    node; it keeps no view) if it does not exist; ``None`` when node sharing is unavailable.
    ``writable`` maps it read-write. The first ``reserve`` bytes (default: all) are allocated before
    ``init`` runs, the rest by :meth:`SharedRegion.reserve` as a writable region fills them."""
    reserve = nbytes if reserve is None else int(reserve)
    dfd = _private_dir()
    if dfd is None or nbytes <= 0:
        return None
    with _dir_lock:
        if not _dir_state.get("cleaned"):
            _dir_state["cleaned"] = True
            _remove_stale(dfd)
    deadline = time.monotonic() + timeout
    while True:
        try:
            lfd = open_private(dfd, f"{name}.lock", os.O_RDWR | os.O_CREAT)
        except OSError as exc:  # not a private regular file of ours (a planted symlink, say)
            logger.warning("node sharing: %s.lock in %s is unusable (%s); keeping a private copy", name, SHM_ROOT, exc)
            return None
        fcntl.flock(lfd, fcntl.LOCK_SH)
        if not _same_file(f"{name}.lock", dfd, lfd):
            os.close(lfd)  # deleted by its last user while we waited: start again
            continue
        try:
            region = _open_or_create(name, nbytes, init, writable, dfd, lfd, deadline, reserve)
        except BaseException as exc:
            _drop_unused_lock(name, dfd, lfd)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
                logger.warning("node sharing: no room for %s (%d bytes) in %s; keeping a private copy",
                               name, nbytes, SHM_ROOT)  # fmt: skip
                return None
            if isinstance(exc, _Unusable):
                logger.warning("node sharing: %s; keeping a private copy", exc)
                return None
            raise
        if region is not None:
            return region
        os.close(lfd)  # start over (the lock file was replaced), or give up
        if time.monotonic() > deadline:
            logger.warning("node sharing: gave up waiting for %s to be created; keeping a private copy", name)
            return None


def _open_or_create(
    name: str,
    nbytes: int,
    init: Callable[[mmap.mmap], None],
    writable: bool,
    dfd: int,
    lfd: int,
    deadline: float,
    reserve: int,
) -> SharedRegion | None:
    """With a shared lock on ``name.lock``: map the region, creating it if it is missing."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    where = f"{SHM_ROOT}/shardkit-{os.geteuid()}/{name}"
    while True:
        try:
            fd = open_private(dfd, name, flags)
        except FileNotFoundError:
            fd = -1
        except OSError as exc:  # a symlink, another owner, group/other permissions: never used
            raise _Unusable(f"{where} is not a private regular file of this user ({exc})") from None
        if fd >= 0:
            size = os.fstat(fd).st_size
            if size != nbytes:
                os.close(fd)
                raise _Unusable(f"{where} has {size} bytes, expected {nbytes}")
            return SharedRegion(name, nbytes, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot), lfd, fd, False)
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # Another process is creating it (or holds it while it is missing). The failed
            # conversion dropped our shared lock: wait without it (a random while, so two waiters
            # cannot keep blocking each other), take it again, start over if the lock file was deleted
            # meanwhile (its last user let go), and look again.
            time.sleep(_POLL * (0.5 + random.random()))
            fcntl.flock(lfd, fcntl.LOCK_SH)
            if not _same_file(f"{name}.lock", dfd, lfd) or time.monotonic() > deadline:
                return None
            continue
        try:
            if not _same_file(f"{name}.lock", dfd, lfd):
                return None  # deleted while we had no lock: start over with the current one
            if exists_at(name, dfd):
                continue  # created meanwhile
            fd = _create(name, nbytes, init, dfd, reserve)
        finally:
            fcntl.flock(lfd, fcntl.LOCK_SH)
        if not writable:
            os.close(fd)
            fd = open_private(dfd, name, flags)
        return SharedRegion(name, nbytes, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot), lfd, fd, True)


def _create(name: str, nbytes: int, init: Callable[[mmap.mmap], None], dfd: int, reserve: int) -> int:
    """Write the region under a temporary name and rename it into place; return a descriptor."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = create_private(dfd, tmp)
    try:
        os.ftruncate(fd, nbytes)
        # Reserve the memory ``init`` writes now: a full tmpfs must fail here (ENOSPC, then a
        # private copy), not with SIGBUS on the first write through the mapping.
        if reserve:
            os.posix_fallocate(fd, 0, min(reserve, nbytes))
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            init(m)
        finally:
            with suppress(BufferError):  # a view is still alive (held by a failing init's traceback): unmapped with it
                m.close()
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        os.close(fd)
        unlink_at(tmp, dfd)
        raise
    return fd


def _after_fork_in_child() -> None:
    for region in list(_live):
        region._forget()
    _dir_state.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------------- users
def dataset_key(path: Path | str, fingerprint: str) -> str:
    """What node-shared regions of a dataset are named by: its real path, its root document's
    inode and modification time, and its SHA-256 (a dataset replaced in place gets new regions);
    for a dataset in an object store (a URL), the URL and the SHA-256."""
    if isinstance(path, str):
        return "\0".join(("url", path, fingerprint))
    real = os.path.realpath(path)
    st = os.stat(os.path.join(real, "zarr.json"))
    return "\0".join(map(str, (real, st.st_dev, st.st_ino, st.st_mtime_ns, fingerprint)))


def node_fields(dataset: Dataset, key: str | None) -> tuple[dict[str, np.ndarray], list[SharedRegion]]:
    """Every per-record field of ``dataset`` as a read-only array, decoded (and checked) once per
    node into a shared region (private arrays when ``key`` is ``None`` or sharing is unavailable),
    and the regions to release."""
    meta = dataset.meta
    fields: dict[str, np.ndarray] = {}
    regions: list[SharedRegion] = []
    for name, spec in meta.fields.items():
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        shape = (meta.num_records, *spec.shape)

        def init(m: mmap.mmap, name: str = name, dtype: np.dtype[Any] = dtype, shape: tuple[int, ...] = shape) -> None:
            out = np.frombuffer(m, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)
            dataset.field(name, out=out)  # no read for a field that came with the dataset's documents
            del out

        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        region = attach(region_name("field", key, name, spec.dtype, spec.shape), nbytes, init) if key else None
        if region is None:
            fields[name] = dataset.field(name)
        else:
            fields[name] = region.array(dtype, shape)
            regions.append(region)
    return fields, regions


def node_permutation(seed: int, epoch: int, n: int) -> tuple[np.ndarray, SharedRegion] | None:
    """The exact epoch order of ``(seed, epoch)`` computed once per node into a shared region (a
    read-only int64 array and its region), or ``None`` when sharing is unavailable."""
    from shardkit.order.schedule import permute_into

    def init(m: mmap.mmap) -> None:
        out = np.frombuffer(m, dtype=np.int64, count=int(n))
        permute_into(seed, epoch, out)
        del out

    region = attach(region_name("order", "epoch", seed, epoch, n), 8 * int(n), init)
    if region is None:
        return None
    return region.array(np.int64, (int(n),)), region
