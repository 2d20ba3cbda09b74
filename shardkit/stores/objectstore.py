"""Object stores (S3-compatible, GCS, Azure, read-only HTTP) through ``obstore``.

``obstore`` (Python bindings of the Rust ``object_store`` crate, which zarr-python 3's
``ObjectStore`` is also built on) does the HTTP: signing, connection pools, concurrent ranged GETs,
multipart uploads. It is an optional extra (``pip install 'shardkit[remote]'``), imported on first
use. Retries, fetch concurrency, copies and the behaviour after ``fork()``: docs/design.md §9.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import logging
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from shardkit.errors import (
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    ShardkitError,
    StoreError,
    StorePermissionError,
    TruncatedShardError,
)
from shardkit.redact import redact_url, redact_urls
from shardkit.stores.base import (
    DEFAULT_OPTIONS,
    ByteRange,
    Fetched,
    ObjectMeta,
    Store,
    StoreOptions,
    check_key,
    write_all,
)
from shardkit.stores.retry import ShortResponse, backoff_seconds, first_line, is_transient
from shardkit.units import human_count

__all__ = ["ObjectStore", "import_obstore", "RequestCounters", "runtime_started"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Smallest chunk a streamed :meth:`ObjectStore.download` writes at once (bounds its memory).
DOWNLOAD_CHUNK_BYTES = 4 << 20
#: Smallest chunk :meth:`ObjectStore.stream_range` hands over at once: small enough to stay in a
#: core's cache between the store client's copy and the sink's (a part's whole body in one buffer
#: was a fresh, cold allocation per part), large enough that the per-chunk cost (the fetch thread's
#: wake-up, the GIL taken back, the sink's Python) is small against the chunk's bytes.
STREAM_CHUNK_BYTES = 512 << 10


class _SinkFailed(BaseException):
    """A sink's own error, carried past the retry policy (it is not the store's failure)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error

def import_obstore() -> Any:
    """``obstore``, or a :class:`~shardkit.errors.MissingExtraError` naming the ``remote`` extra."""
    from shardkit._extras import import_extra

    return import_extra("obstore", "remote", needed_by="shardkit.stores (s3://, gs://, az://, http(s):// datasets)")


# ---------------------------------------------------------------------- the process's event loop
class _Runner:
    """One daemon thread running an asyncio loop for every ObjectStore of this process.

    obstore completes each request on one of its runtime's threads, which then takes the GIL to
    hand the result to Python; if that happens while the interpreter is finalizing, the thread is
    made to exit through Rust frames and the process aborts (SIGABRT at exit). So a request, once
    sent, is left to settle even when its caller is cancelled (:meth:`settle`), and at exit
    (:func:`_quiesce`) the process waits, bounded, until no request is in flight and no thread
    Python did not start is still running Python code: a request settles when the loop runs its
    callback, which can be before obstore's thread has left ``call_soon_threadsafe`` (its write to
    the loop's self-pipe releases the GIL and takes it again). (A blocking call on a daemon thread
    that outlives the interpreter exits its thread without that abort.)
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.inflight: set[asyncio.Future[Any]] = set()  # touched only on the loop's thread
        self.thread = threading.Thread(target=self._run, name="shardkit-store-io", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    async def settle(self, coro: Awaitable[T]) -> T:
        """Await ``coro`` (which awaits obstore); cancelling the caller leaves it running to its end."""
        task = asyncio.ensure_future(coro)
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return await asyncio.shield(task)

    def stop(self, timeout: float) -> None:
        """Cancel every task, wait up to ``timeout`` s for the requests already sent, stop the loop."""
        if os.getpid() != self.pid or not self.thread.is_alive():
            return

        async def drain() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me and t not in self.inflight]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.inflight:
                await asyncio.wait(list(self.inflight), timeout=timeout)

        with suppress(Exception):
            self.submit(drain()).result(timeout + 1.0)
        with suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=1.0)


#: Seconds the process waits at exit for requests in flight (a stalled one is given up on).
EXIT_WAIT_SECONDS = 5.0


def _foreign_threads_in_python() -> list[int]:
    """Threads Python did not start (obstore's runtime threads) that are running Python code now:
    each would take the GIL again, which aborts the process once the interpreter is finalizing."""
    ours = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    return [ident for ident in sys._current_frames() if ident not in ours]


def _quiesce() -> None:
    """At exit: let the requests in flight settle, and obstore's threads leave the Python code
    that hands their results over, before the interpreter finalizes (see _Runner)."""
    global _runner
    runner = _runner
    if runner is not None:
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        runner.stop(EXIT_WAIT_SECONDS)
        with _runner_lock:  # a store used after this (a later exit hook) starts a new loop
            if _runner is runner:
                _runner = None
        while os.getpid() == runner.pid and _foreign_threads_in_python() and time.monotonic() < deadline:
            time.sleep(0.001)  # (releases the GIL for them)


atexit.register(_quiesce)


_runner: _Runner | None = None
_runner_lock = threading.Lock()
#: Set in a child forked from a process that had used obstore: its runtime (tokio) does not
#: survive ``fork()``, so the child gets a StoreError instead of a hang (docs/design.md §9).
_forked_after_use = False
_used = False


def _after_fork_in_child() -> None:
    global _forked_after_use, _runner, _used
    if _used:
        _forked_after_use = True
    _runner = None
    _used = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_fork(url: str) -> None:
    global _used
    if _forked_after_use:
        raise StoreError(
            f"{url}: this process was forked from one that had already used an object store, and obstore's "
            "runtime does not survive fork(); start worker processes with the 'spawn' or 'forkserver' method "
            "(DataLoader(multiprocessing_context='spawn'), which ShardIterableDataset.loader() picks for remote "
            "datasets)"
        )
    _used = True


def runtime_started() -> bool:
    """Whether this process has used obstore (whose runtime then does not survive ``fork()``): until
    it has, a child forked from it can use object stores (docs/design.md §9, Fork)."""
    return _used


def _get_runner() -> _Runner:
    global _runner
    with _runner_lock:
        if _runner is None:
            _runner = _Runner()
        return _runner


class _Pending(Iterator[Fetched]):
    """The responses of one started :meth:`ObjectStore.fetch`, in completion order; :meth:`close`
    (also on garbage collection) cancels the requests not yet delivered."""

    def __init__(self, url: str, n: int, results: queue.Queue[Fetched | BaseException],
                 future: concurrent.futures.Future[None] | None) -> None:
        self._url, self._left, self._results, self._future = url, n, results, future

    def __next__(self) -> Fetched:
        if self._left <= 0 or self._future is None:
            self.close()
            raise StopIteration
        while True:
            try:
                item = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                if self._future.done() and self._results.empty():
                    self.close()
                    self._future.result()  # raises what the driver raised
                    raise StoreError(f"{self._url}: fetch ended without all its ranges") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._left -= 1
        return item

    def close(self) -> None:
        if self._future is not None:
            self._future.cancel()
        self._left = 0

    def __del__(self) -> None:
        self.close()


class RequestCounters:
    """Requests, bytes and retries of one store (thread-safe), for instrumentation and tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0
        self.retries = 0
        #: Ranged requests of :meth:`ObjectStore.fetch` in flight now, and the most ever at once.
        self.in_flight = 0
        self.max_in_flight = 0

    def add(self, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += nbytes
            self.retries += retries

    def flight(self, delta: int) -> None:
        """A ranged request started (``+1``) or ended (``-1``)."""
        with self._lock:
            self.in_flight += delta
            self.max_in_flight = max(self.max_in_flight, self.in_flight)


class _Slots:
    """``n`` request slots shared by coroutines on the store's event loop (:meth:`ObjectStore.fetch`)
    and by threads that make their requests themselves (:meth:`ObjectStore.fetch_range`), first asked
    first served: a freed slot goes to the oldest waiter, of either kind."""

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self._free = n
        self._waiters: collections.deque[threading.Event | asyncio.Future[None]] = collections.deque()

    def acquire(self) -> None:
        """Take a slot, blocking this thread until one is free (never on the event loop's thread)."""
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return
            ready = threading.Event()
            self._waiters.append(ready)
        ready.wait()  # a release hands its slot over by setting it

    async def acquire_async(self) -> None:
        """Take a slot on the event loop; a cancelled waiter gives back a slot it was handed."""
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            with self._lock:
                queued = fut in self._waiters
                if queued:
                    self._waiters.remove(fut)
            if not queued and fut.done() and not fut.cancelled():
                self.release()  # handed a slot, then cancelled before it ran: give it back
            raise  # (a handover still on its way to a cancelled future gives its slot back itself)

    def release(self) -> None:
        """Give a slot back: to the oldest waiter if there is one."""
        with self._lock:
            if not self._waiters:
                self._free += 1
                return
            waiter = self._waiters.popleft()
        if isinstance(waiter, threading.Event):
            waiter.set()
        else:
            waiter.get_loop().call_soon_threadsafe(self._hand, waiter)

    def _hand(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            self.release()
        else:
            fut.set_result(None)


#: obstore attributes that are HTTP headers, not user metadata.
_STANDARD_ATTRIBUTES = frozenset(
    {"Content-Disposition", "Content-Encoding", "Content-Language", "Content-Type", "Cache-Control"}
)


def _meta(d: dict[str, Any], key: str) -> ObjectMeta:
    mtime = d.get("last_modified")
    return ObjectMeta(key, int(d["size"]), d.get("e_tag"), mtime.timestamp() if isinstance(mtime, datetime) else None)


class ObjectStore(Store):
    """A bucket/container prefix or an HTTP base URL as a :class:`~shardkit.stores.base.Store`.

    Built by :func:`shardkit.stores.open_store` around ``inner``, an obstore store rooted at ``url``
    (as the user wrote it; messages show :attr:`url`, redacted); ``read_only`` refuses writes (HTTP).
    """

    def __init__(
        self,
        url: str,
        inner: Any,
        options: StoreOptions = DEFAULT_OPTIONS,
        *,
        read_only: bool = False,
    ) -> None:
        self._location = url.rstrip("/")
        self.url = redact_url(self._location)
        self.inner = inner
        self.options = options
        self._read_only = read_only
        self._obs = import_obstore()
        self.counters = RequestCounters()
        self._rng = random.Random()  # backoff jitter: decorrelates processes, not reproducible on purpose
        #: Slots for the ranged requests of every fetch of this store (``options.concurrency``), of
        #: :meth:`fetch` and :meth:`fetch_range` alike: overlapping fetches share them, first asked first served.
        self._slots = _Slots(options.concurrency)

    @property
    def is_local(self) -> bool:
        return False

    @property
    def location(self) -> str:
        return self._location

    @property
    def read_only(self) -> bool:
        return self._read_only

    # ------------------------------------------------------------------ errors and retries
    def _final_error(self, exc: BaseException, what: str, attempts: int, t0: float) -> Exception:
        """The shardkit error for a failure not retried (again); obstore's text is redacted (it repeats the URL)."""
        text = redact_urls(first_line(exc))
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{what}: not found")
        name = type(exc).__name__
        if isinstance(exc, PermissionError) or name in ("PermissionDeniedError", "UnauthenticatedError"):
            return StorePermissionError(
                f"{what}: access denied ({text}); check the credentials in the environment (docs/object-storage.md "
                "lists the variables)"
            )
        if name == "PreconditionError":
            return ObjectChangedError(f"{what}: the object changed since it was first read (its ETag differs)")
        if name == "AlreadyExistsError":
            return ObjectChangedError(f"{what}: the object already exists (a put made only if it was absent)")
        if is_transient(exc):
            return StoreError(f"{what}: failed after {human_count(attempts, 'attempt')} in {time.monotonic() - t0:.1f} s: {text}")
        return StoreError(f"{what}: {text}")

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """Run a blocking obstore call with the retry policy."""
        _check_fork(self.url)
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                result = fn()
                self.counters.add(requests=1)
                return result
            except ShardkitError:
                raise
            except Exception as exc:
                time.sleep(self._retry_wait(exc, attempt, t0, what))
            attempt += 1

    async def _call_async(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                result = await _get_runner().settle(fn())
                self.counters.add(requests=1)
                return result
            except (asyncio.CancelledError, ShardkitError):
                raise
            except Exception as exc:
                await asyncio.sleep(self._retry_wait(exc, attempt, t0, what))
            attempt += 1

    def _retry_wait(self, exc: Exception, attempt: int, t0: float, what: str) -> float:
        """Seconds to wait before retrying the failed request ``exc``; raises the final error instead
        when it is not transient or the retry budget is spent."""
        self.counters.add(requests=1)
        o = self.options
        if not is_transient(exc) or attempt >= o.retries or time.monotonic() - t0 >= o.retry_seconds:
            raise self._final_error(exc, what, attempt + 1, t0) from None
        self.counters.add(retries=1)
        logger.info("%s: transient failure (%s); retry %d", what, redact_urls(first_line(exc)), attempt + 1)
        return backoff_seconds(attempt, o, self._rng)

    def _writable(self, key: str) -> None:
        """Check ``key`` and that this store can be written."""
        check_key(key, where=self.url)
        if self._read_only:
            raise StorePermissionError(f"{self.describe(key)}: {self.url} is read-only (http(s) stores cannot be written)")

    # ------------------------------------------------------------------ reading
    def head(self, key: str) -> ObjectMeta:
        """Size, ETag and user metadata (a GET with ``head``: obstore's HEAD drops the metadata)."""
        check_key(key, where=self.url)

        def once() -> tuple[dict[str, Any], dict[str, Any]]:
            result = self._obs.get(self.inner, key, options={"head": True})
            return result.meta, dict(result.attributes)

        meta, attributes = self._call(once, self.describe(key))
        user = {k: str(v) for k, v in attributes.items() if k not in _STANDARD_ATTRIBUTES}
        return replace(_meta(meta, key), metadata=user)

    def get(self, key: str, *, max_nbytes: int | None = None) -> bytes:
        """One GET; the size in its headers is checked against ``max_nbytes`` before the body is read."""
        return self.get_tagged(key, max_nbytes=max_nbytes)[0]

    def get_tagged(self, key: str, *, max_nbytes: int | None = None) -> tuple[bytes, str | None]:
        """:meth:`get` and the ETag of the same response (so the two always belong together)."""
        check_key(key, where=self.url)
        what = self.describe(key)

        def once() -> tuple[bytes, str | None]:
            result = self._obs.get(self.inner, key)
            size = int(result.meta["size"])
            if max_nbytes is not None and size > max_nbytes:
                raise ObjectTooLargeError(f"{what}: {size} bytes, more than the {max_nbytes} bytes allowed")
            data = bytes(result.bytes())
            if len(data) != size:
                raise ShortResponse(f"expected {size} bytes, received {len(data)}")
            return data, result.meta.get("e_tag")

        data, etag = self._call(once, what)
        self.counters.add(nbytes=len(data))
        return data, etag

    def fetch(self, ranges: Sequence[ByteRange]) -> Iterator[Fetched]:
        if not ranges:
            return
        yield from self.start_fetch(ranges)

    def start_fetch(self, ranges: Sequence[ByteRange]) -> _Pending:
        """:meth:`fetch`, its requests submitted now (queued behind those of fetches started
        earlier: every fetch of this store shares ``options.concurrency`` slots, first come first
        served), so a reader can ask for its next block's ranges while it still consumes the current
        one. Close the result to cancel what it has not delivered."""
        _check_fork(self.url)
        for r in ranges:
            self._check_range(r)
        results: queue.Queue[Fetched | BaseException] = queue.Queue()
        future = _get_runner().submit(self._drive(ranges, results)) if ranges else None
        return _Pending(self.url, len(ranges), results, future)

    async def _drive(self, ranges: Sequence[ByteRange], results: queue.Queue[Fetched | BaseException]) -> None:
        slots = self._slots

        async def one(i: int, r: ByteRange) -> None:
            await slots.acquire_async()
            try:
                self.counters.flight(1)
                try:
                    got = await self._call_async(lambda: self._get_range_async(i, r), r.describe(self.describe(r.key)))
                finally:
                    self.counters.flight(-1)
            finally:
                slots.release()
            self.counters.add(nbytes=r.nbytes)
            results.put(got)

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(ranges)]
        try:
            for done in asyncio.as_completed(tasks):
                await done
        except BaseException as exc:
            for t in tasks:
                t.cancel()
            if not isinstance(exc, asyncio.CancelledError):
                results.put(exc)
            raise

    def fetch_range(self, r: ByteRange) -> Fetched:
        """One range, requested by the calling thread itself (a synchronous GET with the retry
        policy, in one of the store's slots): no hand-over through the event loop's thread, whose
        futures and queue cost about 0.4 CPU s/GB on 8 MiB parts (docs/design.md §9, *Shard cache*)."""
        _check_fork(self.url)
        self._check_range(r)

        def once() -> Fetched:
            result = self._obs.get(self.inner, r.key, options=self._range_options(r))
            return self._checked_range(0, r, result.meta, result.bytes())

        return self._in_slot(r, lambda: self._call(once, r.describe(self.describe(r.key))))

    def stream_range(self, r: ByteRange, sink: Callable[[int, memoryview], None], *, size: int) -> str | None:
        """As :meth:`Store.stream_range`: one ranged GET made by the calling thread (in one of the
        store's slots, with the retry policy), its body handed to ``sink`` in chunks of at least
        :data:`STREAM_CHUNK_BYTES` as they arrive, never gathered into one buffer: the cache's fetch
        threads write and checksum each chunk while it is in the CPU's cache (docs/design.md §9,
        *Shard cache*). A body cut short or too long is retried from ``r.start``; an error the sink
        raises is raised as it is."""
        _check_fork(self.url)
        self._check_range(r)
        what = r.describe(self.describe(r.key))

        def once() -> str | None:
            result = self._obs.get(self.inner, r.key, options=self._range_options(r))
            total = int(result.meta["size"])
            if total != size:
                raise TruncatedShardError(f"{self.describe(r.key)}: expected {size} bytes, the store says {total}")
            pos = r.start
            for chunk in result.stream(min_chunk_size=STREAM_CHUNK_BYTES):
                view = memoryview(chunk)
                if pos + view.nbytes > r.end:
                    raise ShortResponse(f"expected {r.nbytes} bytes, received more")
                try:
                    sink(pos, view)
                except Exception as exc:
                    raise _SinkFailed(exc) from None
                pos += view.nbytes
            if pos != r.end:  # a body cut short on the way: retried
                raise ShortResponse(f"expected {r.nbytes} bytes, received {pos - r.start}")
            etag = result.meta.get("e_tag")
            return None if etag is None else str(etag)

        def call() -> str | None:
            try:
                return self._call(once, what)
            except _SinkFailed as failed:
                raise failed.error from None

        return self._in_slot(r, call)

    def _check_range(self, r: ByteRange) -> None:
        """``r``'s key is valid here and its range is not empty (checked before any request)."""
        check_key(r.key, where=self.url)
        if r.start < 0 or r.end <= r.start:
            raise StoreError(f"{r.describe(self.describe(r.key))}: not a valid byte range")

    def _in_slot(self, r: ByteRange, request: Callable[[], T]) -> T:
        """Run ``request`` (the calling thread's own GET of ``r``) in one of the store's slots,
        counted in flight while it runs and, once it succeeded, as ``r``'s bytes."""
        self._slots.acquire()
        try:
            self.counters.flight(1)
            try:
                result = request()
            finally:
                self.counters.flight(-1)
        finally:
            self._slots.release()
        self.counters.add(nbytes=r.nbytes)
        return result

    @staticmethod
    def _range_options(r: ByteRange) -> dict[str, Any]:
        options: dict[str, Any] = {"range": (r.start, r.end)}
        if r.etag is not None:
            options["if_match"] = r.etag
        return options

    def _checked_range(self, i: int, r: ByteRange, meta: Mapping[str, Any], data: Any) -> Fetched:
        """A ranged response as :class:`Fetched`, once its object is long enough and its body has
        exactly the asked length (a body cut short or padded on the way is retried)."""
        size = int(meta["size"])
        if r.end > size:  # the object is shorter than the range: no retry can change that
            raise TruncatedShardError(
                f"{r.describe(self.describe(r.key))}: the object is only {size} bytes, the range ends past it"
            )
        view = memoryview(data)  # obstore.Bytes implements the buffer protocol (zero-copy view)
        if view.nbytes != r.nbytes:
            raise ShortResponse(f"expected {r.nbytes} bytes, received {view.nbytes}")
        return Fetched(i, view, size, meta.get("e_tag"))

    async def _get_range_async(self, i: int, r: ByteRange) -> Fetched:
        result = await self._obs.get_async(self.inner, r.key, options=self._range_options(r))
        size = int(result.meta["size"])
        if r.end > size:  # checked before the body is read
            return self._checked_range(i, r, result.meta, b"")
        return self._checked_range(i, r, result.meta, await result.bytes_async())

    def download(self, key: str, fd: int, *, size: int, etag: str | None = None,
                 progress: Callable[[int], None] | None = None) -> str | None:
        """One GET of the whole object streamed into ``fd`` a chunk at a time; returns the ETag.

        A failure mid-body resumes from the first byte not yet written, with ``If-Match`` on the
        first response's ETag (a changed object is :class:`~shardkit.errors.ObjectChangedError`).
        """
        check_key(key, where=self.url)
        what = self.describe(key)
        done = 0  # bytes written: a retry resumes there

        def once() -> None:
            nonlocal done, etag
            options: dict[str, Any] = {}
            if done:
                options["range"] = (done, size)
            if etag is not None:
                options["if_match"] = etag
            result = self._obs.get(self.inner, key, options=options)
            total = int(result.meta["size"])
            if total != size:
                raise TruncatedShardError(f"{what}: expected {size} bytes, the store says {total}")
            etag = etag or result.meta.get("e_tag")
            for chunk in result.stream(min_chunk_size=DOWNLOAD_CHUNK_BYTES):
                view = memoryview(chunk)
                if done + view.nbytes > size:
                    raise ShortResponse(f"received more than the {size} bytes of the object")
                write_all(fd, view, done)
                done += view.nbytes
                self.counters.add(nbytes=view.nbytes)
                if progress is not None:
                    progress(view.nbytes)
            if done != size:
                raise ShortResponse(f"expected {size} bytes, received {done}")

        self._call(once, what)
        return None if etag is None else str(etag)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        base = getattr(self.inner, "prefix", None)
        strip = f"{base}/" if base else ""
        pages = self._call(lambda: [d for page in self._obs.list(self.inner, prefix=prefix or None, chunk_size=1000)
                                    for d in page], self.describe(prefix))
        for d in pages:
            yield _meta(d, str(d["path"]).removeprefix(strip))

    # ------------------------------------------------------------------ writing
    def put(self, key: str, data: bytes | memoryview, *, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        self._writable(key)
        payload = bytes(data)
        attributes = dict(metadata or {})
        self._call(lambda: self._obs.put(self.inner, key, payload, use_multipart=False, attributes=attributes),
                   self.describe(key))
        self.counters.add(nbytes=len(payload))
        return ObjectMeta(key, len(payload), metadata=attributes)

    def put_if_absent(self, key: str, data: bytes, *, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        """:meth:`put` only if ``key`` does not exist (``If-None-Match: *``, one atomic request); an object
        already there is :class:`~shardkit.errors.ObjectChangedError` and is left as it is."""
        self._writable(key)
        attributes = dict(metadata or {})
        self._call(lambda: self._obs.put(self.inner, key, data, mode="create", use_multipart=False, attributes=attributes),
                   self.describe(key))
        self.counters.add(nbytes=len(data))
        return ObjectMeta(key, len(data), metadata=attributes)

    def put_file(
        self, key: str, source: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
    ) -> ObjectMeta:
        """Upload ``source``; multipart (``part_bytes`` parts, ``concurrency`` at once) when it is
        larger than ``multipart_threshold``. A failed upload is retried whole; S3 never shows a
        partial object."""
        self._writable(key)
        size = os.stat(source).st_size
        o = self.options
        attributes = dict(metadata or {})

        def upload() -> Any:
            with open(source, "rb") as fh:
                return self._obs.put(self.inner, key, fh, use_multipart=size > o.multipart_threshold, chunk_size=o.part_bytes,
                                     max_concurrency=min(o.concurrency, 16), attributes=attributes)

        self._call(upload, self.describe(key))
        self.counters.add(nbytes=size)
        return ObjectMeta(key, size, metadata=attributes)

    def delete(self, key: str) -> None:
        self._writable(key)
        with suppress(ObjectNotFoundError):
            self._call(lambda: self._obs.delete(self.inner, key), self.describe(key))

    def copy(self, src: str, dst: str) -> None:
        check_key(src, where=self.url)
        self._writable(dst)
        self._call(lambda: self._obs.copy(self.inner, src, dst), f"{self.describe(src)} -> {dst}")
