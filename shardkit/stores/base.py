"""The byte-store interface every dataset read and write goes through (docs/design.md §2, §9)."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.declare import Parser, UserOptions, option
from shardkit.errors import ConfigError, TruncatedShardError, UnsafePathError
from shardkit.units import human_bytes, parse_bytes, parse_count, parse_duration

__all__ = [
    "Store",
    "ObjectMeta",
    "ByteRange",
    "Fetched",
    "StoreOptions",
    "check_key",
    "DEFAULT_OPTIONS",
    "write_all",
]


@dataclass(frozen=True)
class ObjectMeta:
    """What a store says about one object: its ``key`` (relative to the root) and ``size`` in bytes."""

    key: str
    size: int
    #: The store's version tag (``None`` for local files), pinned by readers with ``If-Match``.
    etag: str | None = None
    #: Last modification, seconds since the epoch (``None`` when the store does not say).
    mtime: float | None = None
    #: User metadata stored with the object (``{"shardkit-crc32c": ...}``); local files have none.
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[start, end)`` of object ``key``; ``etag`` (if set) must still match when it is read."""

    key: str
    start: int
    end: int
    etag: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def describe(self, url: str) -> str:
        return f"{url}: bytes {self.start}-{self.end - 1}"


@dataclass(frozen=True)
class Fetched:
    """One completed range of :meth:`Store.fetch`: which request (``index``), its bytes (exactly
    ``nbytes`` of them, as a buffer), and what the response said about the whole object."""

    index: int
    data: memoryview
    object_size: int
    etag: str | None


def _count(minimum: int) -> Parser:
    return lambda value, what: parse_count(value, what=what, minimum=minimum)


def _bytes(value: Any, what: str) -> int:
    return parse_bytes(value, what=what)


def _seconds(value: Any, what: str) -> float:
    return parse_duration(value, what=what, allow_zero=False)


def _show_seconds(seconds: float) -> str:
    return f"{seconds:g}s"


@dataclass(frozen=True)
class StoreOptions(UserOptions):
    """How an object store is driven: concurrency, timeouts and the retry budget (docs/design.md §9).

    Samplers and adapters hold one whole (``store=StoreOptions(retries=3)``); options with a flag are
    also taken by the flag's name (``remote_concurrency=8``; :func:`~shardkit.declare.nested`).
    """

    concurrency: int = option(32, "Storage", _count(1), flag="--remote-concurrency", cli_type=int,
                              help="For a dataset in an object store: requests in flight at once.")
    request_bytes: int = option(8 << 20, "Storage", _bytes, flag=None, show=human_bytes,
                                help="Largest range one request asks for; longer ones are split into parts fetched in parallel.")
    timeout: float = option(
        60.0, "Storage", _seconds, flag="--remote-timeout", show=_show_seconds,
        help="For a dataset in an object store: a request slower than this counts as a transient failure.")
    connect_timeout: float = option(10.0, "Storage", _seconds, flag=None, show=_show_seconds,
                                    help="A connection slower than this counts as a transient failure.")
    retries: int = option(30, "Storage", _count(0), flag=None, help="Retries of a transient failure, at most.")
    retry_seconds: float = option(
        120.0, "Storage", _seconds, flag="--remote-retry", show=_show_seconds,
        help="For a dataset in an object store: retry transient failures (5xx, timeouts, resets) this long "
             "before failing with an error naming the object and byte range.", doc="The default rides out a server restart.")
    backoff_initial: float = option(0.05, "Storage", _seconds, flag=None, show=_show_seconds, help="The first retry's largest backoff.")
    backoff_max: float = option(5.0, "Storage", _seconds, flag=None, show=_show_seconds, help="The largest backoff between retries.")
    part_bytes: int = option(16 << 20, "Storage", _bytes, flag=None, show=human_bytes,
                             help="put_file uploads a large file in parts of this size (S3: 5 MiB to 5 GiB, at most 10,000).")
    multipart_threshold: int = option(64 << 20, "Storage", _bytes, flag=None, show=human_bytes,
                                      help="put_file uploads files larger than this in parts.")

    KIND = "store option"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.part_bytes < 5 << 20:
            raise ConfigError(f"{self.name('part_bytes')}: S3 needs parts of at least 5 MiB, found {self.part_bytes}")


DEFAULT_OPTIONS = StoreOptions()
StoreOptions.__doc__ = f"{StoreOptions.__doc__}{StoreOptions.describe()}"

_MAX_KEY = 1024


def check_key(key: str, *, what: str = "key", where: str = "") -> str:
    """Return ``key`` if it is a plain relative key inside a store's root, else raise UnsafePathError.

    Refused: empty keys and segments, ``.`` and ``..`` segments, a leading ``/``, ``\\``, control
    characters (smuggled into a request line), and keys longer than 1,024 characters.
    """
    bad = (
        not isinstance(key, str)
        or not key
        or len(key) > _MAX_KEY
        or key.startswith("/")
        or "\\" in key
        or any(ord(c) < 32 or ord(c) == 127 for c in key)
        or any(part in ("", ".", "..") for part in key.split("/"))
    )
    if bad:
        prefix = f"{where}: " if where else ""
        raise UnsafePathError(
            f"{prefix}{what} {key!r} is not a plain relative key inside the dataset (expected '/'-separated "
            "names without '.', '..', empty parts, '\\\\' or control characters)"
        )
    return key


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a short write is continued, never dropped)."""
    view = memoryview(data).cast("B")
    written = 0
    while written < view.nbytes:
        written += os.pwrite(fd, view[written:], offset + written)


class Store(abc.ABC):
    """A root of immutable objects, local directory or object-store prefix; thread-safe (docs/design.md §9).

    Keys are ``/``-separated paths relative to the root, always checked by :func:`check_key`. Errors:
    :class:`~shardkit.errors.ObjectNotFoundError` (a ``FileNotFoundError``),
    :class:`~shardkit.errors.StorePermissionError` (a ``PermissionError``),
    :class:`~shardkit.errors.ObjectChangedError` (a pinned ETag no longer matches), and
    :class:`~shardkit.errors.StoreError` for anything that failed for good, naming the object and range.
    """

    #: The root for messages: a local path, or a URL with its secrets redacted.
    url: str
    options: StoreOptions = DEFAULT_OPTIONS

    # ------------------------------------------------------------------ description
    @property
    @abc.abstractmethod
    def is_local(self) -> bool:
        """True for a local directory (readers then use ``pread``/``mmap`` on :meth:`local_path`)."""

    @property
    def read_only(self) -> bool:
        """True when the store cannot be written (``http(s)://``)."""
        return False

    def local_path(self, key: str = "") -> Path:
        """The local file of ``key`` (only for local stores)."""
        raise ConfigError(f"{self.url}: an object store has no local path; read it through the store")

    @property
    def location(self) -> str:
        """The root as the user wrote it, secrets included: what reopens the store, never shown."""
        return self.url

    def describe(self, key: str) -> str:
        """``url/key`` for messages (before the URL's query, where the store puts the key too)."""
        if not key:
            return self.url
        base, sep, query = self.url.partition("?")
        return f"{base.rstrip('/')}/{key}{sep}{query}"

    # ------------------------------------------------------------------ reading
    @abc.abstractmethod
    def head(self, key: str) -> ObjectMeta:
        """Size and version of ``key``; :class:`~shardkit.errors.ObjectNotFoundError` if absent."""

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except FileNotFoundError:
            return False
        return True

    @abc.abstractmethod
    def get(self, key: str, *, max_nbytes: int | None = None) -> bytes:
        """The whole object. With ``max_nbytes``, an object larger than that is refused
        (:class:`~shardkit.errors.StoreError` naming its size) *before* its bytes are read."""

    def get_tagged(self, key: str, *, max_nbytes: int | None = None) -> tuple[bytes, str | None]:
        """:meth:`get` and the version tag (ETag) of the bytes returned, ``None`` for local files; here
        a HEAD then a GET (an object store answers both with one GET)."""
        etag = None if self.is_local else self.head(key).etag
        return self.get(key, max_nbytes=max_nbytes), etag

    def get_range(self, key: str, start: int, end: int, *, etag: str | None = None) -> memoryview:
        """Bytes ``[start, end)`` of ``key``: exactly ``end - start`` bytes or an error."""
        return next(iter(self.fetch([ByteRange(key, start, end, etag)]))).data

    def fetch_range(self, r: ByteRange) -> Fetched:
        """One range as :class:`Fetched` (its bytes, the object's size and ETag), read by the calling
        thread; stores whose :meth:`fetch` hands responses over from another thread override it to
        skip that hand-over."""
        return next(iter(self.fetch([r])))

    def stream_range(self, r: ByteRange, sink: Callable[[int, memoryview], None], *, size: int) -> str | None:
        """Hand bytes ``[r.start, r.end)`` of ``r.key`` to ``sink(offset, chunk)`` in ascending order and
        return the response's ETag; an object of another ``size`` is a
        :class:`~shardkit.errors.TruncatedShardError` before any byte is handed over. A retry after a
        failure mid-body starts again at ``r.start`` (the sink sees those offsets again). Here one
        :meth:`fetch_range`; object stores stream the body in chunks (no body-sized buffer)."""
        got = self.fetch_range(r)
        if got.object_size != size:
            raise TruncatedShardError(f"{self.describe(r.key)}: expected {size} bytes, the store says {got.object_size}")
        sink(r.start, got.data)
        return got.etag

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> list[memoryview]:
        """Several ranges of one object, fetched concurrently, returned in the order asked."""
        done = self.fetch([ByteRange(key, int(a), int(b)) for a, b in zip(starts, ends)])
        return [got.data for got in sorted(done, key=lambda got: got.index)]

    @abc.abstractmethod
    def fetch(self, ranges: Sequence[ByteRange]) -> Iterator[Fetched]:
        """Read many ranges (of any objects) with up to ``options.concurrency`` requests in flight.

        Yields one :class:`Fetched` per range *in completion order*, each exactly the bytes asked
        for, or raises :class:`~shardkit.errors.StoreError` naming the object and range once retries
        are spent. Leaving the iterator early cancels what is still in flight.
        """

    def download(self, key: str, fd: int, *, size: int, etag: str | None = None,
                 progress: Callable[[int], None] | None = None) -> str | None:
        """Write the whole ``size``-byte object ``key`` into the file ``fd`` (from offset 0) and
        return its ETag; ``etag`` (if set) must still match. ``progress(n)`` is called as each
        ``n`` bytes land. An object of another size is a :class:`~shardkit.errors.TruncatedShardError`.
        """
        limit = self.options.request_bytes
        asks = [ByteRange(key, a, min(a + limit, size), etag) for a in range(0, size, limit)]
        tag = etag
        for got in self.fetch(asks):
            if got.object_size != size:
                raise TruncatedShardError(f"{self.describe(key)}: expected {size} bytes, the store says {got.object_size}")
            tag = tag or got.etag
            write_all(fd, got.data, asks[got.index].start)
            if progress is not None:
                progress(got.data.nbytes)
        return tag

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        """Every object under the "directory" ``prefix`` (whole ``/``-separated segments, as object
        stores list: ``image`` lists ``image/...``, not ``images/...``; ``""`` lists everything)."""

    # ------------------------------------------------------------------ writing
    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        """Write ``data`` as ``key`` atomically (whole or not at all), replacing any object there,
        with user ``metadata`` where the store keeps it (object stores; ignored for local files)."""

    @abc.abstractmethod
    def put_file(
        self, key: str, source: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
    ) -> ObjectMeta:
        """Upload the local file ``source`` as ``key`` atomically; multipart when it is large (see
        :class:`StoreOptions`); ``metadata`` as in :meth:`put`."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it does not exist)."""

    @abc.abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` inside this store (server-side on object stores)."""

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (atomic locally; copy then delete on object stores)."""
        self.copy(src, dst)
        self.delete(src)

    def close(self) -> None:  # noqa: B027 - optional hook, stores without resources need nothing
        """Release connections (optional)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Stores travel to DataLoader workers and processes as their URL and options; each process
        # opens its own connections.
        from shardkit.stores.url import open_store

        return (open_store, (self.location, self.options))
