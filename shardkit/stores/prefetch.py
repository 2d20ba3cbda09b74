"""Whole-object downloads of a remote dataset's shards into the local cache, behind the epoch.

Why whole objects, and how they are bounded, pinned and checked: docs/design.md §9 (*Shard cache*).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardkit.errors import CorruptShardError, TruncatedShardError
from shardkit.stores.atomic import is_out_of_space
from shardkit.stores.base import Store
from shardkit.stores.cache import ShardCache

__all__ = ["ShardPrefetcher", "PrefetchItem", "PREFETCH_CONCURRENCY"]

logger = logging.getLogger(__name__)

#: Whole-object downloads in flight at once (at most; never more than the store's concurrency).
#: Eight 32 MiB GETs keep the measured loopback and +20/+50 ms links at their whole-object
#: bandwidth (``benchmarks/remote.py``: more in flight gained nothing).
PREFETCH_CONCURRENCY = 8

_QUEUED, _ACTIVE, _DONE, _SKIPPED, _FAILED = range(5)


@dataclass(frozen=True)
class PrefetchItem:
    """One object to download: ``key`` in the store, ``name`` in the cache, its recorded ``size``."""

    key: str
    name: str
    size: int


class _Stop(BaseException):
    """The prefetcher is closing (a BaseException: the store's retry loop must not retry it)."""


class ShardPrefetcher:
    """Downloads ``items`` (in the order given: ascending shards) into ``cache`` in the background.

    ``verify(index, fd)``: the complete copy of ``items[index]`` has its recorded checksums.
    ``pin(index, etag)``: checks the ETag a download saw against the ranged reads' (raising
    :class:`~shardkit.errors.ObjectChangedError`), returns the ETag to match (``If-Match``) or None.
    ``account(index, nbytes)``: counts the request.
    """

    def __init__(
        self,
        store: Store,
        cache: ShardCache,
        items: Sequence[PrefetchItem],
        *,
        verify: Callable[[int, int], bool],
        pin: Callable[[int, str | None], str | None],
        account: Callable[[int, int], None],
        concurrency: int = PREFETCH_CONCURRENCY,
    ) -> None:
        self.store = store
        self.cache = cache
        self.items = list(items)
        self._verify = verify
        self._pin = pin
        self._account = account
        self._state = [_QUEUED] * len(self.items)
        self._errors: dict[int, BaseException] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._closing = False
        self.error: BaseException | None = None
        n = max(1, min(concurrency, store.options.concurrency, len(self.items)))
        self._threads = [threading.Thread(target=self._work, name=f"shardkit-prefetch-{k}", daemon=True) for k in range(n)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ reader side
    def pending(self, index: int) -> bool:
        """``items[index]`` is queued or being downloaded by this prefetcher."""
        with self._cond:
            return self._state[index] in (_QUEUED, _ACTIVE)

    def wait(self, index: int) -> bool:
        """Block until ``items[index]`` is no longer pending; True if its copy is now complete.
        Raises the download's error, so it is never silently replaced by ranged reads."""
        with self._cond:
            while self._state[index] in (_QUEUED, _ACTIVE) and not self._closing:
                self._cond.wait(1.0)
            if self._state[index] == _FAILED:
                raise self._errors[index]
            return self._state[index] == _DONE

    def raise_error(self) -> None:
        """Re-raise the first download failure (called before each block read)."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop: downloads in progress are abandoned (their ``.part`` deleted), threads joined."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(30.0)

    # ------------------------------------------------------------------ worker side
    def _take(self) -> int | None:
        with self._cond:
            if self._closing or self._next >= len(self.items):
                return None
            i = self._next
            self._next += 1
            self._state[i] = _ACTIVE
            return i

    def _finish(self, i: int, state: int, error: BaseException | None = None) -> None:
        with self._cond:
            self._state[i] = state
            if error is not None:
                self._errors[i] = error
                if self.error is None:
                    self.error = error
            self._cond.notify_all()

    def _work(self) -> None:
        while (i := self._take()) is not None:
            try:
                state = self._download(i)
            except _Stop:
                self._finish(i, _SKIPPED)
                return
            except BaseException as exc:  # reported to the reader, which raises it
                logger.debug("prefetch of %s failed", self.items[i].key, exc_info=True)
                self._finish(i, _FAILED, exc)
                if not isinstance(exc, Exception):
                    raise
                return
            self._finish(i, state)

    def _download(self, i: int) -> int:
        item = self.items[i]
        fd = self.cache.claim(item.name, item.size)
        if fd is None:
            return _SKIPPED  # complete already, filled by another process, or over the budget

        def progress(_: int) -> None:
            if self._closing:
                raise _Stop

        t0 = time.monotonic()
        try:
            etag = self.store.download(item.key, fd, size=item.size, etag=self._pin(i, None), progress=progress)
            self._pin(i, etag)
        except BaseException as exc:
            self.cache.abandon(item.name, fd)
            if isinstance(exc, TruncatedShardError):  # replaced by a newer version, or damaged (a ranged read says so)
                logger.info("%s: %s; read by range", item.key, exc)
            elif is_out_of_space(exc):
                logger.warning("%s: no space left for the cache; %s stays remote", self.cache.dir, item.name)
            else:
                raise
            self.cache.refuse(item.name)
            return _SKIPPED
        self._account(i, item.size)
        if not self.cache.complete(item.name, fd, item.size, lambda f: self._verify(i, f)):
            raise CorruptShardError(
                f"{self.store.describe(item.key)}: the object's bytes do not match the size and crc32c recorded in "
                "the dataset metadata; refused (not cached, not read)"
            )
        logger.debug("prefetched %s (%d bytes) in %.2f s", item.key, item.size, time.monotonic() - t0)
        return _DONE
