"""A local directory as a :class:`~shardkit.stores.base.Store`.

Keys resolve under the root with symlinks followed and must stay inside it (:func:`resolve_inside`);
every file is opened through :func:`open_regular`, so a pipe or device never blocks a reader; writes
are atomic (:mod:`shardkit.stores.atomic`).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from shardkit.errors import ObjectNotFoundError, ObjectTooLargeError, TruncatedShardError, UnsafePathError
from shardkit.stores.atomic import atomic_file, fsync_dir, write_bytes_atomic
from shardkit.stores.base import DEFAULT_OPTIONS, ByteRange, Fetched, ObjectMeta, Store, StoreOptions, check_key

__all__ = ["LocalStore", "resolve_inside", "open_regular"]

_COPY_CHUNK = 8 << 20


def resolve_inside(root: Path, relative: str | Path, what: str) -> Path:
    """``root / relative`` with symlinks resolved, refused unless it lies inside ``root`` (it need not exist)."""
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafePathError(f"{root}: {what} path {str(relative)!r} leaves the dataset directory")
    base = root.resolve()
    target = (root / rel).resolve()
    if target != base and base not in target.parents:
        raise UnsafePathError(
            f"{root / rel}: {what} resolves to {target}, outside the dataset directory {base} (a symlink?)"
        )
    return target


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def _refuse_special(path: str | os.PathLike[str], mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UnsafePathError(f"{os.fspath(path)}: expected a {what} (a regular file), found {kind}")


def open_regular(path: str | os.PathLike[str], what: str = "dataset file") -> int:
    """A read-only descriptor of the regular file ``path``, never blocking on a special file.

    Checked with ``stat``, opened ``O_NONBLOCK`` (a named pipe would wait for a writer forever) and
    checked again with ``fstat``. UnsafePathError for a directory, pipe, socket or device;
    FileNotFoundError when ``path`` does not exist (the caller names what is missing).
    """
    _refuse_special(path, os.stat(path).st_mode, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _refuse_special(path, os.fstat(fd).st_mode, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalStore(Store):
    """Objects are files under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], options: StoreOptions = DEFAULT_OPTIONS) -> None:
        self.root = Path(root)
        self.url = str(root)
        self.options = options

    @property
    def is_local(self) -> bool:
        return True

    def local_path(self, key: str = "") -> Path:
        """The resolved file of ``key`` inside the root (UnsafePathError if it would leave it)."""
        return self._file(key) if key else self.root

    def _file(self, key: str) -> Path:
        """The file of an object key (never the root itself)."""
        return resolve_inside(self.root, check_key(key, where=self.url), "dataset file")

    def _open(self, key: str) -> int:
        """:func:`open_regular` of the file of ``key``; ObjectNotFoundError if there is none."""
        try:
            return open_regular(self._file(key), "file")
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.describe(key)}: no such file") from None

    def describe(self, key: str) -> str:
        return str(self.root / key) if key else str(self.root)

    # ------------------------------------------------------------------ reading
    def head(self, key: str) -> ObjectMeta:
        path = self._file(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.describe(key)}: no such file") from None
        if stat.S_ISDIR(st.st_mode):
            raise ObjectNotFoundError(f"{self.describe(key)}: expected a file, found a directory")
        _refuse_special(self.describe(key), st.st_mode, "file")
        return ObjectMeta(key, st.st_size, None, st.st_mtime)

    def get(self, key: str, *, max_nbytes: int | None = None) -> bytes:
        meta = self.head(key)
        if max_nbytes is not None and meta.size > max_nbytes:
            raise ObjectTooLargeError(f"{self.describe(key)}: {meta.size} bytes, more than the {max_nbytes} bytes allowed")
        with os.fdopen(self._open(key), "rb") as fh:
            data = fh.read() if max_nbytes is None else fh.read(max_nbytes + 1)
        if max_nbytes is not None and len(data) > max_nbytes:  # it grew after the stat
            raise ObjectTooLargeError(f"{self.describe(key)}: more than the {max_nbytes} bytes allowed")
        return data

    def fetch(self, ranges: Sequence[ByteRange]) -> Iterator[Fetched]:
        """Each range with ``pread`` in the calling thread (local disks need no concurrency here)."""
        for i, r in enumerate(ranges):
            fd = self._open(r.key)
            try:
                size = os.fstat(fd).st_size
                view = memoryview(bytearray(r.nbytes))
                got = 0
                while got < r.nbytes:
                    n = os.preadv(fd, [view[got:]], r.start + got)
                    if n <= 0:
                        raise TruncatedShardError(
                            f"{r.describe(self.describe(r.key))}: the file ended after {got} of {r.nbytes} bytes"
                        )
                    got += n
            finally:
                os.close(fd)
            yield Fetched(i, view, size, None)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        # Keys are relative to ``top``, never to ``self.root`` (relative, while a resolved ``top`` is absolute).
        head = prefix.strip("/")
        top = self.local_path(head) if head else self.root
        if not top.is_dir():
            return
        for dirpath, _dirs, files in os.walk(top):
            for name in sorted(files):
                full = Path(dirpath) / name
                rel = full.relative_to(top).as_posix()
                key = f"{head}/{rel}" if head else rel
                st = full.stat()
                yield ObjectMeta(key, st.st_size, None, st.st_mtime)

    # ------------------------------------------------------------------ writing
    def put(self, key: str, data: bytes | memoryview, *, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        write_bytes_atomic(self._file(key), bytes(data))
        return self.head(key)

    def put_file(
        self, key: str, source: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
    ) -> ObjectMeta:
        """Copy ``source`` to ``key`` through ``key.partial`` (fsynced, then renamed)."""
        with (atomic_file(self._file(key), doing="copying") as fd, open(fd, "wb", closefd=False) as dst,
              os.fdopen(open_regular(source, "file"), "rb") as src):
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
        return self.head(key)

    def delete(self, key: str) -> None:
        self._file(key).unlink(missing_ok=True)

    def copy(self, src: str, dst: str) -> None:
        self.put_file(dst, self._file(src))

    def rename(self, src: str, dst: str) -> None:
        """``os.replace``: atomic on one file system."""
        target = self._file(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(self._file(src), target)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe(src)}: no such file") from None
        fsync_dir(target.parent)
