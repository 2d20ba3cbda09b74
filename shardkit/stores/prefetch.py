"""Downloads of a remote dataset's shards into the local cache, in parallel ranged parts, behind
the epoch; records are readable from a copy as soon as their pages are local.

Why parts, the progress map, demand before background order, and how downloads are bounded, pinned
and checked: docs/design.md §9 (*Shard cache*).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field

from shardkit.errors import CorruptShardError, TruncatedShardError
from shardkit.formats.checksums import extend_fd_crc32c
from shardkit.formats.index import combine_crc32c, extend_crc32c
from shardkit.stores.atomic import is_out_of_space
from shardkit.stores.base import ByteRange, Store, write_all
from shardkit.stores.cache import LAST_PRIORITY, PAGE_BYTES, STALE_SECONDS, ShardCache, filler_alive, map_pages

__all__ = ["ShardPrefetcher", "PrefetchItem", "PrefetchStats", "PartialCopy", "Delivery", "PART_BYTES",
           "MAX_PARTS_IN_FLIGHT", "DEMAND_GAP_PAGES", "demand_gap_pages", "all_present", "grid_cell"]

logger = logging.getLogger(__name__)

#: Background parts streaming at once (each through one fetch thread while it lands), from the first
#: request on: the link is full while the reader still plans its first block. The width adds the
#: parts waiting for their first byte (:func:`parts_in_flight`); never more than the store's
#: concurrency (docs/design.md §9).
MAX_PARTS_IN_FLIGHT = 16
#: Size of a background part (a multiple of PAGE_BYTES); a shard no larger is fetched whole.
#: 8 MiB matches ``StoreOptions.request_bytes``, the size the ranged path already splits long reads
#: at; it was not re-tuned here (the shared benchmark machine was too loaded to resolve 4 vs 16 MiB).
PART_BYTES = 8 << 20
#: A part holds at least this many gaps' worth of pages that :func:`demand_gap_pages` merges.
DEMAND_GAPS_PER_PART = 4
#: Asked-for pages this close (256 KiB) are merged whatever the part size (a round trip costs more).
DEMAND_GAP_PAGES = 4


def parts_in_flight(streaming: int, rate: float, latency: float, part_bytes: int, most: int) -> int:
    """Background parts to keep in flight: ``streaming`` parts receiving bytes, plus those waiting
    for their first byte, at most ``most`` (the store's concurrency).

    The bandwidth-delay rule: parts start at ``rate / part_bytes`` a second (``rate``: bytes a second
    the download lands) and each waits ``latency`` seconds (its request to its first byte), so by
    Little's law ``rate * latency / part_bytes`` of them wait at any moment. Counting them in the
    streaming width would leave that many fewer parts receiving, the more so the higher the latency;
    a part waiting on a slow first byte takes a slot of its own instead (docs/design.md §9).
    """
    waiting = math.ceil(rate * latency / part_bytes) if rate > 0 and latency > 0 else 0
    return max(1, min(most, streaming + waiting))


class _Link:
    """What the download measures of the link, for :func:`parts_in_flight`: the time from a part's
    request to its first byte (the mean of the last parts, so a stall is forgotten) and the bytes a
    second that land since the first request."""

    #: Weight of each new part's first-byte time in the mean (about the last ten parts).
    WEIGHT = 0.1

    def __init__(self) -> None:
        self.latency = 0.0
        self.landed = 0
        self.started: float | None = None

    def request(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def first_byte(self, seconds: float) -> None:
        self.latency = seconds if not self.latency else self.latency + self.WEIGHT * (seconds - self.latency)

    def rate(self, now: float) -> float:
        """Bytes a second landed since the first request (0 before it)."""
        if self.started is None or now <= self.started:
            return 0.0
        return self.landed / (now - self.started)


def demand_gap_pages() -> int:
    """Asked-for pages at most this many pages apart are fetched in one request, the gap with them:
    a quarter of a part, at least :data:`DEMAND_GAP_PAGES` (read when called: tests shrink the parts).

    Why: a gap left behind is fetched later anyway, as a request of its own smaller than a part,
    so merging costs no byte and saves that request (the store's request rate, not its bandwidth,
    bounds small requests). A request stops at a part, so a wider gap saves fewer: at a quarter of a
    part each merged request still carries the asks of about four gaps, and a block waits for at most
    a quarter of a part of bytes it does not need yet per ask (docs/design.md §9, *Shard cache*).
    """
    return max(DEMAND_GAP_PAGES, PART_BYTES // PAGE_BYTES // DEMAND_GAPS_PER_PART)


def grid_cell(p: int, npages: int) -> tuple[int, int]:
    """The cell of the part grid that holds page ``p`` of a copy of ``npages``: ``[k * per, (k + 1)
    * per)``, ``per`` a part's pages, the last cell taking a rest of at most a quarter part (a
    shard's index and tail after its last whole cell).

    Why a grid: parts cut where a reader asked leave the rest of their cells as small requests of
    their own, and a store keeps an object in chunks (SeaweedFS: 4 MiB) that a part across their
    edges reads twice; why the remainder joins: it would be a request of a page or two, made last
    (docs/design.md §9, *Shard cache*)."""
    per = max(1, PART_BYTES // PAGE_BYTES)
    rem = npages % per
    joined = npages >= per and 0 < rem <= per // DEMAND_GAPS_PER_PART
    lo = p // per * per
    if joined and lo >= npages - rem:
        lo -= per
    return lo, npages if joined and lo == npages - rem - per else min(npages, lo + per)


#: How often a process waiting on another's copy looks at its progress map, and checks the filler lives.
POLL_SECONDS = 0.005
_ALIVE_EVERY = 40
#: Where a filler's watcher has no wake-up FIFO (:meth:`ShardCache.listen`): how often it looks at
#: the cache's ask counter (:meth:`ShardCache.ask`) while other processes ask (within
#: :data:`ASKING_SECONDS` of the counter's last change). With a FIFO it sleeps until an ask writes
#: it, or :data:`_WANTED_POLL_SECONDS`.
ASK_POLL_SECONDS = 0.002
#: Where no FIFO can be made: how often it looks while nobody else asked lately.
QUIET_POLL_SECONDS = 0.02
#: How long after the ask counter changed a watcher without a FIFO keeps looking every ASK_POLL_SECONDS.
ASKING_SECONDS = 1.0
#: How often the watcher reads every copy's map even when the counter did not change (a safety net,
#: which also notices an asker that wakes no FIFO).
_WANTED_POLL_SECONDS = 0.1
#: How long an idle fetch thread sleeps when nobody wakes it (a safety net: work is notified).
_IDLE_SECONDS = 1.0

#: Background parts in flight while a prefetcher opens: until the first pages a reader asks for have
#: landed (or :data:`OPENING_SECONDS` pass with no ask), so a first block's parts share the link with
#: two parts nobody waits for, not with the full width (docs/design.md §9, *Shard cache*).
OPENING_BACKGROUND = 2
OPENING_SECONDS = 1.0
#: Tests set this to an unset Event to hold back the background order (demanded pages still flow).
hold_background: threading.Event | None = None


def ask_poll_seconds(since_ask: float) -> float:
    """A watcher without a wake-up FIFO: its next look at the ask counter, ``since_ask`` seconds
    after it last changed: soon while other processes ask, else rarely. Why: each look wakes a
    thread that takes the GIL from the fetch threads, and a process reading alone never changes the
    counter (its own readers ask the fetch threads directly); docs/design.md §9 (*Shard cache*)."""
    return ASK_POLL_SECONDS if since_ask < ASKING_SECONDS else QUIET_POLL_SECONDS


def all_present(flags: bytes | bytearray, spans: Iterable[tuple[int, int]]) -> bool:
    """Every page of ``spans`` (``[lo, hi)`` each) is flagged in ``flags`` (a copy's present flags):
    one C-level search for a zero per span, no slice copied and no Python per page. Why: a reader
    waiting for a block's runs checks every run each time a part lands, under the prefetcher's lock."""
    return all(flags.find(0, lo, hi) < 0 for lo, hi in spans)


#: A map's asked-for bytes (``1 + priority``, 0 where not asked) as flags: 1 where asked.
_ASKED = bytes([0] + [1] * 255)


def _background_held() -> bool:
    return hold_background is not None and not hold_background.is_set()


_QUEUED, _ACTIVE, _DONE, _SKIPPED, _FAILED = range(5)


@dataclass(frozen=True)
class PrefetchItem:
    """One object to download: ``key`` in the store, ``name`` in the cache, its recorded ``size``;
    its checksums are taken over ``[0, data_nbytes)`` and over the whole object."""

    key: str
    name: str
    size: int
    data_nbytes: int = 0


@dataclass
class PrefetchStats:
    """Where a download's time goes (summed over the fetch threads, seconds), to compare a cold
    epoch with raw GETs of the same bytes: ``receive`` waits for a part's response, ``write`` copies
    it into the copy, ``crc`` checksums it while it is in memory, ``settle`` finishes a copy (the
    checksums combined, flush, rename); ``reader_wait`` is the time readers waited for pages."""

    parts_demanded: int = 0
    parts_background: int = 0
    bytes: int = 0
    receive_s: float = 0.0
    write_s: float = 0.0
    crc_s: float = 0.0
    settle_s: float = 0.0
    #: Bytes checksummed by reading the copy back (pages a resumed fill found, whole-object GETs).
    reread_bytes: int = 0
    #: Record bytes the fetch threads copied straight into a waiting block's rows (never read back
    #: from the copy), and the time those copies took (part of ``write_s``'s thread, not counted in it).
    delivered_bytes: int = 0
    deliver_s: float = 0.0
    reader_wait_s: float = 0.0
    #: CPU time of the fetch threads (their own, not the store client's I/O threads).
    cpu_s: float = 0.0
    most_in_flight: int = 0
    #: Seconds from each part's request to its first byte, summed; the background width last chosen.
    first_byte_s: float = 0.0
    width: int = 0
    #: ``(seconds since start, asked-for parts in flight, background parts in flight)`` at each
    #: change (the first 100,000), for a plot of the download.
    in_flight: list[tuple[float, int, int]] = field(default_factory=list)


class _Stop(BaseException):
    """The prefetcher is closing (a BaseException: the store's retry loop must not retry it)."""


class Delivery:
    """Records of one block run that the fetch threads copy into their rows as their chunks land
    (:meth:`PartialCopy.deliver`): record ``k`` is bytes ``offs[k]:ends[k]`` of the shard, its row
    ``rows[k]``. ``got[k]`` counts its bytes that came in parts which passed every check (counted
    when the part succeeds); a record is delivered once ``got[k]`` is its size, and only then.
    A chunk's bytes are copied as it lands (while it is in the CPU's cache); a retried part copies
    them again from its first byte, so the rows hold the part's last, checked response."""

    def __init__(self, fill: _Fill, which: list[int], offs: list[int], ends: list[int], rows: list[memoryview]) -> None:
        #: The records' indexes in the caller's list.
        self.which = which
        self.fill, self.offs, self.ends, self.rows = fill, offs, ends, rows
        self.got = [0] * len(offs)
        #: The records' first and last byte: a chunk outside them is passed by at once (a fill has
        #: a delivery per run of every block waiting for it, and each chunk is offered to all).
        self.lo, self.hi = (offs[0], ends[-1]) if offs else (0, 0)

    def delivered(self) -> list[bool]:
        """Which records are entirely in their rows, from checked parts."""
        return [g == e - o for g, o, e in zip(self.got, self.offs, self.ends)]

    def _overlapping(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """``(k, a, b)``: each record ``k`` with bytes in ``start:end``, and those bytes ``a:b``."""
        k = bisect.bisect_right(self.ends, start)
        while k < len(self.offs) and self.offs[k] < end:
            yield k, max(self.offs[k], start), min(self.ends[k], end)
            k += 1

    def copy(self, pos: int, chunk: memoryview) -> int:
        """Copy the bytes of ``chunk`` (at ``pos`` in the shard) that belong to these records into
        their rows; returns how many (called under the fill's ``deliver_lock``)."""
        if pos >= self.hi or pos + chunk.nbytes <= self.lo:
            return 0
        n = 0
        for k, a, b in self._overlapping(pos, pos + chunk.nbytes):
            o = self.offs[k]
            self.rows[k][a - o : b - o] = chunk[a - pos : b - pos]
            n += b - a
        return n

    def landed(self, start: int, end: int) -> None:
        """Bytes ``start:end`` came in a part that passed its checks (under the prefetcher's lock)."""
        for k, a, b in self._overlapping(start, end):
            self.got[k] += b - a


class _Fill:
    """A copy this process claimed and fills: which pages are present or in flight."""

    def __init__(self, index: int, item: PrefetchItem, fd: int, map_fd: int) -> None:
        self.index, self.item, self.fd, self.map_fd = index, item, fd, map_fd
        self.npages = map_pages(item.size)
        self.present = bytearray(self.npages)
        self.busy = bytearray(self.npages)
        self.next_bg = 0
        #: The pages other processes asked for, as the watcher last read them from the map.
        self.wanted = bytes(self.npages)
        self.inflight = 0
        self.error: BaseException | None = None
        self.done = 0
        #: ``start -> (end, crc32c)`` of the byte ranges this fill wrote, none across ``data_nbytes``.
        self.crcs: dict[int, tuple[int, int]] = {}
        #: Blocks waiting for records of this copy (:class:`Delivery`): changed under the
        #: prefetcher's lock and this one, read by the fetch threads' sinks under this one only.
        self.deliveries: list[Delivery] = []
        #: The parts streaming now (under ``deliver_lock``): a record whose bytes one of them has not
        #: reached yet can still be delivered from it.
        self.sinks: list[_PartSink] = []
        self.deliver_lock = threading.Lock()

    def deliverable(self, start: int, end: int) -> bool:
        """Every byte of ``start:end`` is still to come through a sink: its pages are free (a part
        not started yet), or in a part streaming now that has not reached them (under both locks)."""
        for p in range(start // PAGE_BYTES, -(-end // PAGE_BYTES)):
            if self.present[p]:
                return False
            if self.busy[p]:
                first = max(start, p * PAGE_BYTES)
                if not any(s.start <= first < s.end and s.next <= first for s in self.sinks):
                    return False  # a whole-object GET, a part not streaming yet, or one past these bytes
        return True

    def free(self, p: int) -> bool:
        return not self.present[p] and not self.busy[p]

    def span(self, lo: int, hi: int, wanted: bytes | None = None) -> tuple[int, int] | None:
        """The first run of free pages in ``lo:hi`` within one cell of the part grid
        (:func:`grid_cell`; only ``wanted`` ones, with gaps of up to :func:`demand_gap_pages`, if given)."""
        p = lo
        if wanted is None:
            while p < hi and not self.free(p):
                p += 1
        else:  # jump from one asked-for page to the next (usually none: one C-level scan)
            p = wanted.find(1, p, hi)
            while p >= 0 and not self.free(p):
                p = wanted.find(1, p + 1, hi)
            if p < 0:
                return None
        if p >= hi:
            return None
        gap = demand_gap_pages()
        end, last, cell = p + 1, p, min(hi, grid_cell(p, self.npages)[1])  # never across the part grid
        while end < cell and self.free(end):
            if wanted is not None and not wanted[end]:
                if end - last > gap:
                    break
            else:
                last = end
            end += 1
        return p, (last + 1 if wanted is not None else end)

    def joined(self, lo: int, hi: int) -> tuple[int, int]:
        """``lo:hi``, free pages within one cell (:meth:`span`), with the pieces of their free run in
        the cells next to them when one of the two is under a quarter part (a piece of a cell that
        asked-for pages left, which would be a small request of its own): at most one piece on each
        side, so a part is at most a cell and a quarter part on each side of it.

        Why: the first block asks for its records' pages, and each cell it touches is left in
        pieces; a piece joined with its neighbour costs no byte and one request less
        (docs/design.md §9, *Shard cache*)."""
        quarter = max(1, PART_BYTES // PAGE_BYTES // DEMAND_GAPS_PER_PART)
        cell_lo, cell_hi = grid_cell(lo, self.npages)
        start, end = lo, hi
        if lo == cell_lo and lo > 0 and self.free(lo - 1):  # the run goes on in the cell before
            before, first = grid_cell(lo - 1, self.npages)[0], lo - 1
            while first > before and self.free(first - 1):
                first -= 1
            if hi - lo < quarter or lo - first < quarter:
                start = first
        if hi == cell_hi and hi < self.npages and self.free(hi):  # the run goes on in the cell after
            after, last = grid_cell(hi, self.npages)[1], hi + 1
            while last < after and self.free(last):
                last += 1
            if hi - lo < quarter or last - hi < quarter:
                end = last
        return start, end


class ShardPrefetcher:
    """Downloads ``items`` (ascending shards) into ``cache`` in the background, in parts.

    Pages a reader asks for (:meth:`copy`, :meth:`PartialCopy.request`) are fetched before the
    background order, which starts at once (the link is never idle while the first block is
    planned) but with :data:`OPENING_BACKGROUND` parts until the first asked-for pages have landed
    (the first block's parts do not queue behind a full width of them), and pauses while
    asked-for parts are in flight: a block's records do not share the link with parts nobody waits
    for yet. Pages another process asks for through a copy's map come next.
    ``verify(index, data_crc, crc)``: the crc32c of ``items[index]``'s first ``data_nbytes`` and of all
    its bytes are the recorded ones (computed from each part as it lands, then combined).
    ``pin(index, etag)``: checks the ETag a response carried against the ranged reads' (raising
    :class:`~shardkit.errors.ObjectChangedError`), returns the ETag to match (``If-Match``) or None.
    ``account(index, nbytes)``: counts one request. ``order``: the first :meth:`schedule`.
    ``fillers``: the processes that fill this cache together (a DataLoader's workers), each keeping
    its share of :data:`MAX_PARTS_IN_FLIGHT` streaming, so that together they keep what one would.
    """

    def __init__(
        self,
        store: Store,
        cache: ShardCache,
        items: Sequence[PrefetchItem],
        *,
        verify: Callable[[int, int, int], bool],
        pin: Callable[[int, str | None], str | None],
        account: Callable[[int, int], None],
        order: Sequence[tuple[int, int, int]] = (),
        fillers: int = 1,
    ) -> None:
        self.store = store
        self.cache = cache
        self.items = list(items)
        self._verify = verify
        self._pin = pin
        self._account = account
        self._state = [_QUEUED] * len(self.items)
        self._errors: dict[int, BaseException] = {}
        self._fills: dict[int, _Fill] = {}
        #: Items whose every page landed in checked parts, being checked and named (:meth:`_settle`):
        #: their pages are readable from the copy meanwhile, so a reader need not wait for the rename.
        self._landed: set[int] = set()
        #: Asked-for page spans ``(priority, serial, item, lo, hi)``, a heap: the lowest priority
        #: first (a reader's first block before later blocks, the first batch's before others), first
        #: asked first served within one (:data:`~shardkit.stores.cache.LAST_PRIORITY`).
        self._demand: list[tuple[int, int, int, int, int]] = []
        self._serial = itertools.count()
        #: ``(item, lo, hi)`` page spans in the order blocks will need them (:meth:`schedule`): the
        #: background order, before the shard-by-shard one.
        self._order: deque[tuple[int, int, int]] = deque(order)
        self._next = 0
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # readers: states and pages changed
        self._wake = threading.Condition(lock)  # workers: work to pick (woken one at a time when a slot frees)
        self._closing = False
        self.error: BaseException | None = None
        total = max(1, min(store.options.concurrency, MAX_PARTS_IN_FLIGHT * 2))
        self._most_bg = max(1, min(store.options.concurrency, total))
        #: This process's share of the background parts streaming (docs/design.md §9, *Shard cache*).
        self._streaming = max(1, -(-MAX_PARTS_IN_FLIGHT // max(1, int(fillers))))
        self._max_bg = max(1, min(self._streaming, self._most_bg))
        self._link = _Link()
        self._bg_active = 0
        self._demand_active = 0
        self._opening = True  # the background is held to OPENING_BACKGROUND parts (:meth:`_bg_width`)
        self._asked = False
        self.stats = PrefetchStats()
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._work, args=(k,), name=f"shardkit-prefetch-{k}", daemon=True)
                         for k in range(total)]  # fmt: skip
        self._filling = threading.Event()  # set while there are fills (the watcher sleeps otherwise)
        self._stopped = threading.Event()
        #: Readable when another process asks (None: the watcher polls the counter); the watcher closes it.
        self._listener = cache.listen()
        self._watcher = threading.Thread(target=self._watch, name="shardkit-prefetch-watch", daemon=True)
        for t in [*self._threads, self._watcher]:
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

    def ready(self, waits: Sequence[tuple[PartialCopy, list[tuple[int, int]]]]) -> list[bool]:
        """Which of ``waits`` (copies and the pages wanted from each) :meth:`PartialCopy.wait` would
        return at once for; blocks until at least one. Copies this process fills are watched as
        their parts land (so a reader takes runs in the order their pages arrive); a copy another
        process fills counts as ready (its wait polls the map)."""
        with self._cond:
            while True:
                flags = [not c.owned or self._settled_or_present(c.index, spans) for c, spans in waits]
                if any(flags) or not waits or self._closing:
                    return flags if any(flags) else [True] * len(waits)
                self._cond.wait(1.0)

    def _settled_or_present(self, index: int, spans: list[tuple[int, int]]) -> bool:
        fill = self._fills.get(index)
        return fill is None or all_present(fill.present, spans)

    def raise_error(self) -> None:
        """Re-raise the first download failure (called before each block read)."""
        if self.error is not None:
            raise self.error

    def copy(self, index: int) -> PartialCopy | None:
        """A view of ``items[index]``'s copy being filled, by this process (claimed now if it was
        still queued) or by another one (taken over if that one died); None when there is none:
        the copy is complete, stays remote, or failed (:meth:`raise_error`)."""
        item = self.items[index]
        with self._cond:
            if self._state[index] == _FAILED:
                raise self._errors[index]
            if self._state[index] == _QUEUED or (self._state[index] == _SKIPPED and not self.cache.refused(item.name)):
                self._open(index)
            fill = self._fills.get(index)
        if fill is None:
            fds = self.cache.open_partial(item.name)
            return None if fds is None else PartialCopy(self, index, item.size, fds[0], fds[1], owned=False)
        fds = self.cache.open_partial(item.name)
        return None if fds is None else PartialCopy(self, index, item.size, fds[0], fds[1], owned=True)

    def undeliver(self, delivery: Delivery) -> None:
        """No more copies into ``delivery``'s rows once this returns (a sink copying now is waited
        for); any time, also after its copy completed or failed (:meth:`PartialCopy.deliver`).
        The delivery lets go of its rows here: a fetch thread may keep the object a while (its
        last loop variable), and a row it views keeps a batch buffer from being reused."""
        with self._cond, delivery.fill.deliver_lock:
            with suppress(ValueError):
                delivery.fill.deliveries.remove(delivery)
            delivery.rows = []

    def schedule(self, parts: Sequence[tuple[int, int, int]]) -> None:
        """The background order from now on: ``(index, lo, hi)`` page spans of ``items``, in the order
        the coming reads need them (the epoch's block schedule, known up front); pages it leaves out
        follow shard by shard. Replaces an earlier schedule. Why: docs/design.md §9 (*Shard cache*)."""
        with self._cond:
            self._order = deque(parts)
            self._wake.notify_all()

    def close(self) -> None:
        """Stop: threads joined; copies being filled are left for the next filler (of any process) to
        resume from their present pages."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._wake.notify_all()
        self._stopped.set()
        self._filling.set()
        if self._listener is not None:
            self._listener.wake()
        deadline = time.monotonic() + 30.0  # a part stalled on a dead server: give up on it
        for t in [*self._threads, self._watcher]:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None and not self._watcher.is_alive():
            self._listener.close()  # (closed by the watcher already, but for one that never ran)
        with self._cond:
            for fill in list(self._fills.values()):
                if fill.inflight == 0:  # kept, with its map, for the next filler to resume
                    del self._fills[fill.index]
                    os.close(fill.map_fd)
                    self.cache.release(fill.fd)
                    self._finish(fill.index, _SKIPPED)

    # ------------------------------------------------------------------ scheduling (under the lock)
    def _open(self, i: int) -> _Fill | None:
        item = self.items[i]
        try:
            fd = self.cache.claim(item.name, item.size)
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            logger.warning("%s: no space left for the cache; %s stays remote", self.cache.dir, item.name)
            self.cache.refuse(item.name)
            fd = None
        if fd is None:
            self._state[i] = _SKIPPED  # complete already, filled by another process, or over the budget
            return None
        fill = _Fill(i, item, fd, self.cache.open_map(item.name))
        fill.present[:] = ShardCache.present(fill.map_fd, item.size)  # a resumed copy's pages
        fill.done = sum(fill.present)
        self._state[i] = _ACTIVE
        if fill.done == fill.npages:
            self._settle(fill)
            return None
        self._fills[i] = fill
        self._filling.set()
        return fill

    def _demanded(self, i: int, spans: list[tuple[int, int]], priority: int = 0) -> None:
        """Queue asked-for pages at ``priority`` (0 first); wake as many idle threads as they make
        parts, not all of them (a block asks once per shard, and every woken thread scans the fills
        under the lock)."""
        per = max(1, PART_BYTES // PAGE_BYTES)
        with self._cond:
            for lo, hi in spans:
                heapq.heappush(self._demand, (priority, next(self._serial), i, lo, hi))
            self._asked = self._asked or bool(spans)
            self._wake.notify(min(len(self._threads), sum(-(-(hi - lo) // per) for lo, hi in spans)))

    def _pick(self) -> tuple[_Fill, int, int, bool] | None:
        """The next part to fetch: asked for (here or by another process; lowest priority first, then first
        asked first served), then the lowest shard's next pages (opening the next shard when the open ones have none)."""
        while self._demand:
            priority, serial, i, lo, hi = heapq.heappop(self._demand)
            fill = self._fills.get(i)
            if fill is None or fill.error is not None:
                continue
            got = fill.span(lo, hi)
            if got is not None:
                if got[1] < hi:  # the rest keeps its place
                    heapq.heappush(self._demand, (priority, serial, i, got[1], hi))
                if (lo, hi) == (grid_cell(lo, fill.npages)[0], grid_cell(hi - 1, fill.npages)[1]):
                    got = fill.joined(*got)  # whole cells (a later block's): joined as the background's
                return fill, got[0], got[1], True
        if self._bg_active >= self._bg_width() or self._demand_active or _background_held():
            return None
        got_next = self._scheduled()
        if got_next is not None:
            return got_next
        for fill in sorted(self._fills.values(), key=lambda f: f.index):
            if fill.error is None:
                got = fill.span(fill.next_bg, fill.npages)
                if got is not None:
                    fill.next_bg = got[0]
                    got = fill.joined(*got)
                    return fill, got[0], got[1], False
        while self._next < len(self.items):
            i = self._next
            self._next += 1
            try:
                fill = self._open(i) if self._state[i] == _QUEUED else None
            except Exception as exc:  # reported to the reader, which raises it
                self._finish(i, _FAILED, exc)
                continue
            if fill is not None:
                got = fill.span(0, fill.npages)
                assert got is not None
                return fill, got[0], got[1], False
        return None

    def _scheduled(self) -> tuple[_Fill, int, int, bool] | None:
        """The next free pages of :meth:`schedule`'s order (its item opened when still queued)."""
        while self._order:
            i, lo, hi = self._order[0]
            if self._state[i] == _QUEUED:
                try:
                    self._open(i)
                except Exception as exc:  # reported to the reader, which raises it
                    self._finish(i, _FAILED, exc)
            fill = self._fills.get(i)
            got = fill.span(lo, hi) if fill is not None and fill.error is None else None
            if got is None or fill is None:
                self._order.popleft()
                continue
            if got[1] < hi:
                self._order[0] = (i, got[1], hi)
            else:
                self._order.popleft()
            got = fill.joined(*got)
            return fill, got[0], got[1], False
        return None

    def _bg_width(self) -> int:
        """The background parts that may be in flight now (under the lock): :data:`OPENING_BACKGROUND`
        until the first asked-for pages have all landed, or :data:`OPENING_SECONDS` passed with no
        ask, then the width the link measures (:meth:`_measured`)."""
        if self._opening and (
            (self._asked and not self._demand and not self._demand_active)
            or (not self._asked and time.monotonic() - self._t0 >= OPENING_SECONDS)
        ):
            self._opening = False
        return min(self._max_bg, OPENING_BACKGROUND) if self._opening else self._max_bg

    def _measured(self, nbytes: int, first_byte_s: float) -> None:
        """A part of ``nbytes`` landed after waiting ``first_byte_s`` for its first byte: the
        background width follows the link (:func:`parts_in_flight`; under the lock)."""
        link = self._link
        link.landed += nbytes
        link.first_byte(first_byte_s)
        self.stats.first_byte_s += first_byte_s
        width = parts_in_flight(self._streaming, link.rate(time.monotonic()), link.latency, PART_BYTES,
                                self._most_bg)
        if width > self._max_bg and not self._demand_active:
            self._wake.notify(width - self._max_bg)
        self._max_bg = self.stats.width = width

    def _count_in_flight(self) -> None:
        self.stats.most_in_flight = max(self.stats.most_in_flight, self._demand_active + self._bg_active)
        if len(self.stats.in_flight) < 100_000:  # bounded: a long run keeps its beginning
            self.stats.in_flight.append((time.monotonic() - self._t0, self._demand_active, self._bg_active))

    def _finish(self, i: int, state: int, error: BaseException | None = None) -> None:
        self._state[i] = state
        self._landed.discard(i)
        if error is not None:
            self._errors[i] = error
            if self.error is None:
                self.error = error
        self._cond.notify_all()

    # ------------------------------------------------------------------ worker side
    def _work(self, k: int) -> None:
        try:
            self._work_loop(k)
        finally:
            self._add_time("cpu_s", time.thread_time())

    def _work_loop(self, k: int) -> None:
        while True:
            with self._cond:
                task = None
                while task is None:
                    if self._closing:
                        return
                    task = self._pick()
                    if task is None:  # woken by work (the watcher, for other processes' requests)
                        self._wake.wait(_IDLE_SECONDS)
                fill, lo, hi, demanded = task
                fill.busy[lo:hi] = b"\1" * (hi - lo)
                fill.inflight += 1
                if demanded:
                    self._demand_active += 1
                    self.stats.parts_demanded += 1
                else:
                    self._bg_active += 1
                    self.stats.parts_background += 1
                self._count_in_flight()
                self._link.request(time.monotonic())
            error: BaseException | None = None
            streamed = False
            try:
                streamed = self._fetch(fill, lo, hi)
            except BaseException as exc:
                error = exc
            with self._cond:
                fill.inflight -= 1
                fill.busy[lo:hi] = bytes(hi - lo)
                if demanded:
                    self._demand_active -= 1
                    if not self._demand_active and not _background_held():
                        self._wake.notify(max(0, self._max_bg - self._bg_active))  # the background may go on
                else:
                    self._bg_active -= 1
                self._count_in_flight()
                if error is None:
                    fill.present[lo:hi] = b"\1" * (hi - lo)
                    fill.done += hi - lo
                    for delivery in fill.deliveries if streamed else ():  # (a whole-object GET copies none)
                        delivery.landed(lo * PAGE_BYTES, min(hi * PAGE_BYTES, fill.item.size))
                elif fill.error is None:
                    fill.error = error
                self._cond.notify_all()
                self._wake.notify()
                if fill.inflight or (fill.error is None and fill.done < fill.npages):
                    continue
                del self._fills[fill.index]
                if fill.error is None:
                    self._landed.add(fill.index)
            self._settle(fill)

    def _watch(self) -> None:
        """While there are fills: look at the copies' maps as soon as another process asked for
        pages (the cache's ask counter changed) and wake as many fetch threads as the new requests
        make parts, so they are fetched next whatever the threads are doing (docs/design.md §9).
        Sleeps on its wake-up FIFO until an ask writes it, rather than looking every few
        milliseconds while other processes ask (each look takes the GIL from the fetch threads);
        without one it polls the counter (:func:`ask_poll_seconds`). Closes the FIFO when it ends."""
        try:
            self._watch_asks()
        finally:
            if self._listener is not None:
                self._listener.close()

    def _watch_asks(self) -> None:
        last: bytes | None = None
        scanned, heard = 0.0, -math.inf
        while not self._stopped.is_set():
            if not self._fills:
                self._filling.clear()
                if not self._fills:
                    self._filling.wait()
                    continue
            mark = self.cache.asked()
            now = time.monotonic()
            if last is not None and mark != last:
                heard = now  # another process asks: look often for a while (without a FIFO)
            if mark != last or now - scanned >= _WANTED_POLL_SECONDS:
                last, scanned = mark, now
                self._look_at_maps()  # (the first look finds what was asked before this started)
            if self._listener is None or not self._listener.wait(_WANTED_POLL_SECONDS):
                self._stopped.wait(ask_poll_seconds(now - heard))

    def _look_at_maps(self) -> None:
        """Read every fill's asked-for pages from its map and queue the new ones at the priority
        they were asked at, behind the demand already queued at that priority (first asked, first
        served: a block of this process asking later does not overtake another process's earlier
        block); wake a thread per part they make."""
        with self._cond:
            parts = 0
            for fill in self._fills.values():
                if fill.error is not None:
                    continue
                wanted = ShardCache.wanted(fill.map_fd, fill.item.size)
                if wanted == fill.wanted:
                    continue
                asked = wanted.translate(_ASKED)
                new = (int.from_bytes(asked) & ~int.from_bytes(fill.wanted.translate(_ASKED))).to_bytes(fill.npages)
                fill.wanted = wanted
                p = 0
                while (got := fill.span(p, fill.npages, new)) is not None:
                    lo, hi = got
                    priority = min(b for b in wanted[lo:hi] if b) - 1  # (the span starts at an asked page)
                    heapq.heappush(self._demand, (priority, next(self._serial), fill.index, lo, hi))
                    parts += 1
                    p = hi
            if parts:
                self._asked = True
                self._wake.notify(min(parts, len(self._threads)))

    def _settle(self, fill: _Fill) -> None:
        """A fill with nothing in flight that is complete or failed: named, dropped or reported."""
        i, item, exc = fill.index, fill.item, fill.error
        os.close(fill.map_fd)
        if exc is None:
            t0 = time.perf_counter()
            ok = self.cache.complete(item.name, fill.fd, item.size, lambda f: self._verify(i, *self._digest(fill)))
            self._add_time("settle_s", time.perf_counter() - t0)
            if not ok:
                exc = CorruptShardError(
                    f"{self.store.describe(item.key)}: the object's bytes do not match the size and crc32c recorded in "
                    "the dataset metadata; refused (not cached, not read)"
                )
                with self._cond:
                    self._finish(i, _FAILED, exc)
                return
            with self._cond:
                self._finish(i, _DONE)
            return
        if isinstance(exc, _Stop):  # closed while a part streamed: kept for the next filler, as in close()
            self.cache.release(fill.fd)  # (the cut part's pages were never marked present: fetched again)
            with self._cond:
                self._finish(i, _SKIPPED)
            return
        self.cache.abandon(item.name, fill.fd)
        with self._cond:
            if isinstance(exc, TruncatedShardError) or is_out_of_space(exc):
                # replaced by a newer version, or damaged (a ranged read says so); or no room
                logger.info("%s: %s; read by range", item.key, exc)
                self.cache.refuse(item.name)
                self._finish(i, _SKIPPED)
            else:
                logger.debug("prefetch of %s failed", item.key, exc_info=exc)
                self._finish(i, _FAILED, exc)

    def _add_time(self, name: str, seconds: float) -> None:
        with self._cond:
            setattr(self.stats, name, getattr(self.stats, name) + seconds)

    def _digest(self, fill: _Fill) -> tuple[int, int]:
        """``(crc32c of the first data_nbytes, crc32c of all)`` of a complete copy: the parts' own
        checksums combined; ranges this fill did not checksum as they landed are read back."""
        size, split = fill.item.size, fill.item.data_nbytes
        data_crc = crc = pos = 0
        for start, (end, part_crc) in sorted(fill.crcs.items()):
            if start < pos:  # overlapping ranges cannot happen (a page is fetched once): trust the file
                crc, data_crc = self._reread_into(fill, 0, size, 0, 0)
                return data_crc, crc
            if start > pos:
                crc, data_crc = self._reread_into(fill, pos, start, crc, data_crc)
            if end <= split:
                data_crc = combine_crc32c(data_crc, part_crc, end - start)
            crc = combine_crc32c(crc, part_crc, end - start)
            pos = end
        if pos < size:
            crc, data_crc = self._reread_into(fill, pos, size, crc, data_crc)
        return data_crc, crc

    def _reread_into(self, fill: _Fill, start: int, end: int, crc: int, data_crc: int) -> tuple[int, int]:
        """Extend ``crc`` (and ``data_crc`` below ``data_nbytes``) with bytes ``start:end`` of the copy."""
        data_crc, crc, pos = extend_fd_crc32c(fill.fd, fill.item.data_nbytes, start, end, data_crc, crc)
        if pos < end:
            raise TruncatedShardError(f"{self.cache.dir}/{fill.item.name}: expected {end} bytes, the copy ends at {pos}")
        with self._cond:
            self.stats.reread_bytes += end - start
        return crc, data_crc

    def _fetch(self, fill: _Fill, lo: int, hi: int) -> bool:
        """Pages ``lo:hi`` of ``fill``, written and marked present (the whole object in one GET
        without a range when that is what they are); each response's size and ETag are checked.
        True when the part went through a :class:`_PartSink` (which copies waiting records)."""
        i, item = fill.index, fill.item
        if self._closing:
            raise _Stop
        start, end = lo * PAGE_BYTES, min(hi * PAGE_BYTES, item.size)

        t0 = time.perf_counter()
        first: list[float] = []

        def progress(_: int) -> None:
            if self._closing:
                raise _Stop
            if not first:
                first.append(time.perf_counter())

        crcs: list[tuple[int, int, int]] = []
        delivered, deliver_s = 0, 0.0
        if start == 0 and end == item.size:  # checksummed from the copy when it completes
            etag = self.store.download(item.key, fill.fd, size=item.size, etag=self._pin(i, None), progress=progress)
            t1 = t2 = t3 = time.perf_counter()
        else:
            cut = min(max(item.data_nbytes, start), end)  # checksums never span data_nbytes
            part = _PartSink(fill, start, cut, end, lambda: self._closing, first)
            with fill.deliver_lock:
                fill.sinks.append(part)
            try:
                etag = self.store.stream_range(ByteRange(item.key, start, end, self._pin(i, None)), part, size=item.size)
            finally:
                with fill.deliver_lock:
                    fill.sinks.remove(part)
            crcs = [(a, b, c) for a, b, c in ((start, cut, part.crcs[0]), (cut, end, part.crcs[1])) if b > a]
            t3 = time.perf_counter()
            t1 = t3 - part.write_s - part.crc_s - part.deliver_s  # receive, then write, crc and copies
            t2, t3 = t1 + part.write_s, t1 + part.write_s + part.crc_s
            delivered, deliver_s = part.delivered, part.deliver_s
        self._pin(i, etag)
        self._account(i, end - start)
        with self._cond:
            self._measured(end - start, (first[0] if first else t3) - t0)
            for a, b, c in crcs:
                fill.crcs[a] = (b, c)
            st = self.stats
            st.receive_s, st.write_s, st.crc_s = st.receive_s + t1 - t0, st.write_s + t2 - t1, st.crc_s + t3 - t2
            st.bytes += end - start
            st.delivered_bytes += delivered
            st.deliver_s += deliver_s
        ShardCache.mark_present(fill.map_fd, lo, hi)
        return bool(crcs)


class _PartSink:
    """Writes a part's chunks into the copy as they arrive and checksums them while they are in the
    CPU's cache: ``crcs`` are those of ``[start, cut)`` and ``[cut, end)`` (a retry starts over).
    Bytes a waiting block asked for (``fill.deliveries``) are copied into its rows from the chunk
    too; the block takes them only once the part succeeded (:class:`Delivery`)."""

    def __init__(self, fill: _Fill, start: int, cut: int, end: int, closing: Callable[[], bool],
                 first: list[float]) -> None:
        self.fill, self.fd, self.start, self.cut, self.end, self.closing = fill, fill.fd, start, cut, end, closing
        #: When the first chunk came (appended once: the part's wait for its first byte).
        self.first = first
        self.crcs = [0, 0]
        self.write_s = self.crc_s = self.deliver_s = 0.0
        self.delivered = 0
        #: The first byte not copied yet (changed under the fill's ``deliver_lock``): records from
        #: here on can still be registered for delivery from this part.
        self.next = start

    def __call__(self, pos: int, chunk: memoryview) -> None:
        if self.closing():
            raise _Stop
        t = time.perf_counter()
        if pos == self.start:
            self.crcs = [0, 0]  # the response begins (again, after a retry)
            self.delivered = 0
            if not self.first:
                self.first.append(t)
        with self.fill.deliver_lock:
            if self.fill.deliveries:
                self.delivered += sum(d.copy(pos, chunk) for d in self.fill.deliveries)
            self.next = pos + chunk.nbytes  # (a retry starts again at ``start``)
        self.deliver_s += time.perf_counter() - t
        t0 = time.perf_counter()
        write_all(self.fd, chunk, pos)
        t1 = time.perf_counter()
        k = max(0, min(self.cut - pos, chunk.nbytes))  # bytes before data_nbytes
        if k:
            self.crcs[0] = extend_crc32c(self.crcs[0], chunk[:k])
        if k < chunk.nbytes:
            self.crcs[1] = extend_crc32c(self.crcs[1], chunk[k:])
        self.write_s += t1 - t0
        self.crc_s += time.perf_counter() - t1


class PartialCopy:
    """A reader's view of a copy being filled, by this process (``owned``) or another one.

    Holds its own descriptors (valid after the copy completes or is abandoned). Pages are asked for
    with :meth:`request` and waited for with :meth:`wait`; :meth:`close` releases it.
    """

    def __init__(self, owner: ShardPrefetcher, index: int, size: int, fd: int, map_fd: int, *, owned: bool) -> None:
        self.owner, self.index, self.size, self.fd, self.map_fd, self.owned = owner, index, size, fd, map_fd, owned

    def request(self, spans: list[tuple[int, int]], priority: int = 0) -> None:
        """The pages of ``spans`` (``[lo, hi)`` each) are needed now: fetched before the background
        order, after what was asked at a lower ``priority`` (at most ``LAST_PRIORITY``)."""
        priority = min(max(priority, 0), LAST_PRIORITY)
        if self.owned:
            self.owner._demanded(self.index, spans, priority)
        else:
            for lo, hi in spans:
                ShardCache.want(self.map_fd, self.size, lo, hi, priority)
            self.owner.cache.ask()  # the filler's watcher looks at the map now

    def deliver(self, offs: list[int], ends: list[int], rows: list[memoryview]) -> Delivery | None:
        """Have the fetch threads copy records (bytes ``offs[k]:ends[k]``, ascending) into ``rows[k]``
        as their chunks land, for those whose bytes all still have to come through this process's
        parts (pages not fetched yet, or not reached yet by a part streaming now);
        None when none is (the others are read from the copy once present). Takes rows as they are
        given: the caller calls :meth:`undeliver` before it reads them or lets them go."""
        pf = self.owner
        if not self.owned:
            return None
        with pf._cond:
            fill = pf._fills.get(self.index)
            if fill is None or fill.error is not None:
                return None
            with fill.deliver_lock:  # the sinks' progress holds still while the records are chosen
                keep = [k for k, (o, e) in enumerate(zip(offs, ends)) if fill.deliverable(o, e)]
                if not keep:
                    return None
                delivery = Delivery(fill, keep, [offs[k] for k in keep], [ends[k] for k in keep], [rows[k] for k in keep])
                fill.deliveries.append(delivery)
            return delivery

    def undeliver(self, delivery: Delivery) -> None:
        """No more copies into ``delivery``'s rows once this returns (a sink copying now is waited for)."""
        self.owner.undeliver(delivery)

    def wait(self, spans: list[tuple[int, int]]) -> bool:
        """Block until every page of ``spans`` is present (True), or the fill ended without them
        (False: the caller looks again where the copy is); the fill's error is raised."""
        pf = self.owner
        t0 = time.perf_counter()
        try:
            return self._wait(spans)
        finally:
            pf._add_time("reader_wait_s", time.perf_counter() - t0)

    def _wait(self, spans: list[tuple[int, int]]) -> bool:
        pf = self.owner
        if self.owned:
            with pf._cond:
                while True:
                    fill = pf._fills.get(self.index)
                    if fill is None:
                        state = pf._state[self.index]
                        if state == _ACTIVE and self.index in pf._landed:
                            return True  # every page is in the copy; it is being checked and named
                        if state == _ACTIVE and not pf._closing:  # a resumed copy being checked: its outcome
                            pf._cond.wait(1.0)
                            continue
                        if state == _FAILED:
                            raise pf._errors[self.index]
                        return state == _DONE
                    if all_present(fill.present, spans):
                        return True
                    if pf._closing:
                        return False
                    pf._cond.wait(1.0)
        polls = 0
        while True:
            if all_present(ShardCache.present(self.map_fd, self.size), spans):
                return True
            polls += 1
            if polls % _ALIVE_EVERY == 0 and (not filler_alive(self.fd) or _stale(self.fd)):
                return all_present(ShardCache.present(self.map_fd, self.size), spans)
            if pf._closing:
                return False
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.map_fd)


def _stale(fd: int) -> bool:
    """The copy ``fd`` saw no write for STALE_SECONDS: its filler hangs (the next claim replaces it)."""
    return time.time() - os.fstat(fd).st_mtime >= STALE_SECONDS
