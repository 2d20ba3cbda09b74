"""The background half of the tiered sampler: SSD creator, block reader and batch assembler threads
of one run (docs/design.md §4, *The pipeline*)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shardkit import stopping
from shardkit.errors import SamplerError, ShardkitError
from shardkit.formats import DEFAULT_GAP_BYTES, PayloadArray
from shardkit.formats.arrays import distinct_sorted
from shardkit.formats.decode_threads import DecodeJob, finish_decodes
from shardkit.formats.reader import Destination, SortedRequest, SortScratch, aligned_empty, byte_records
from shardkit.order.schedule import BATCH_PREFETCH, EpochOrder, PlanShape, block_bounds
from shardkit.readers.options import TierSizes
from shardkit.readers.sources import MixedDataset, MixedIdentity, Mixture
from shardkit.stopping import POLL_SECONDS, Stopped
from shardkit.tiers.buffers import BatchBuffer, BatchPool
from shardkit.tiers.mapped import AnnounceAhead, Lacking, MappedShards
from shardkit.tiers.ssd import SsdSpace
from shardkit.tiers.ssd_slots import ReservoirSlots, SlotWrite
from shardkit.tiers.static_cache import Ahead, StaticCache
from shardkit.tiers.stats import SamplerStats

if TYPE_CHECKING:  # node_cache imports the shared stack's run directory, which imports this module
    from shardkit.tiers.node_cache import NodeDiskCache

__all__ = [
    "Segment",
    "ReservoirWritten",
    "BlockRead",
    "EpochEnd",
    "RunDone",
    "BatchReady",
    "SlotSink",
    "Pipeline",
    "assemble_batch",
    "gather_rows",
    "reservoir_bounds",
    "POLL_SECONDS",
    "BATCH_PREFETCH",
]

logger = logging.getLogger(__name__)

#: Rows copied per numpy call when gathering scattered rows (a small temporary stays in the CPU cache).
_GATHER_ROWS = 8
#: Scattered rows of at least this many bytes are copied one by one (one copy each, no temporary):
#: the call per row costs less than a second copy through a temporary.
_ROW_COPY_BYTES = 16 << 10
#: Plan positions whose keys are computed at once (the positions' temporaries are a few times this).
_KEY_PIECE = 1 << 18
#: Block keys looked up in the static cache at once (the lookup's temporaries are ~11 bytes a key).
_LOOKUP_PIECE = 1 << 16


@dataclass(frozen=True, eq=False)
class Segment:
    """One epoch's share of a consumer: its plan (positions and batches), the epoch's order, and
    what to release once every key was computed (a node-shared order)."""

    epoch: int
    shape: PlanShape
    order: EpochOrder
    #: False when the plan was cut short by ``limit`` (the epoch is not over after it).
    complete: bool = True
    release: Callable[[], None] | None = field(default=None, repr=False)
    #: The run's last segment: nothing is read after it, so its last SSD reservoirs shrink (see
    #: :func:`reservoir_bounds`).
    last: bool = False

    def keys(self, a: int, b: int, dtype: type[np.signedinteger[Any]] = np.int64) -> np.ndarray:
        """Keys of plan positions ``[a, b)``, computed in pieces: the positions' temporaries stay
        bounded whatever the block's size. ``dtype`` int32 (keys below 2**31): half the bytes a block key."""
        out = np.empty(max(0, int(b) - int(a)), dtype=dtype)
        for c in range(int(a), int(b), _KEY_PIECE):
            d = min(int(b), c + _KEY_PIECE)
            out[c - a : d - a] = self.order.keys(self.shape.epoch_positions(c, d))
        return out

    @property
    def length(self) -> int:
        return self.shape.length

    def done(self) -> None:
        """Every key was computed: let go of the order's shared memory."""
        if self.release is not None:
            self.release()


# Items that travel between the threads (the diagram is in docs/design.md §4, The pipeline).
@dataclass(frozen=True, eq=False)
class ReservoirWritten:
    """SSD creator -> block reader: plan positions ``[start, stop)`` of ``segment`` (``keys``) are on
    SSD in slot ``slot``, which holds ``stored``, their unpinned keys, in ascending order (empty
    when all of them are in the static cache). ``keep``: once the run's final reservoirs shrink, the
    most records a later one writes into this slot (it is cut to that once read back); ``None``
    before."""

    segment: Segment
    start: int
    stop: int
    keys: np.ndarray
    stored: np.ndarray
    slot: int
    keep: int | None = None


@dataclass(frozen=True, eq=False)
class _Copy:
    """Block positions ``positions`` (relative to the block's start, ascending) are rows ``rows``
    of ``source`` (the static cache's rows, or a block of records the cache had no room for)."""

    positions: np.ndarray
    source: np.ndarray
    rows: np.ndarray
    #: The rows are the static cache's (counted as its hits).
    cached: bool = False


class _StageSorts(SortScratch):
    """The staged blocks' sort arrays (:class:`SortScratch`'s, for the reader thread): one packed
    key array for the sort, and each staging slot's own order and duplicate flags, which travel
    with its block to the assembler (:class:`_Stage`) and are sorted into again only once the slot
    is free. Kept at the largest block's size (``block``, the plan's largest, or twice a smaller
    block's, so the growing first blocks reallocate a few times only)."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self._block = int(block)
        self._packed: np.ndarray | None = None
        self._kept: list[tuple[np.ndarray, np.ndarray] | None] = [None, None]
        #: The slot the next sort is for.
        self.slot = 0

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        size = max(n, min(2 * n, self._block))
        dtype = np.int32 if size < 1 << 31 else np.int64
        kept = self._kept[self.slot]
        if kept is None or kept[0].size < n or kept[0].dtype != dtype:
            self._kept[self.slot] = kept = None  # the smaller arrays go before the larger ones are allocated
            kept = self._kept[self.slot] = (np.empty(size, dtype), np.empty(size, bool))
        if self._packed is None or self._packed.size < n:
            self._packed = None
            self._packed = np.empty(size, np.int64)
        return self._packed[:n], kept[0][:n], kept[1][:n]


@dataclass(frozen=True, eq=False)
class _Stage:
    """A staged block (docs/design.md §4, *Staged blocks*): its distinct keys' records in ascending
    key order as opaque records (``records``, a view of staging buffer ``slot``), and the block's
    sort: ``order[i]``, the block position of the ``i``-th key in ascending order, and ``dup`` (``None``
    without duplicates), from which the assembler ranks the block (:func:`ranks`)."""

    slot: int
    records: np.ndarray
    order: np.ndarray
    dup: np.ndarray | None


def ranked(keys: np.ndarray, bound: int, scratch: SortScratch | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct, rank)``: the distinct ``keys`` (in ``[0, bound)``) ascending and, for each key,
    its index in them (int32 below 2**31 keys): ``distinct[rank] == keys``. One sort of the block,
    then :func:`ranks`; ``distinct`` is a view of ``scratch``'s arrays (valid until this thread's
    next sort with it)."""
    req = SortedRequest.of(keys, bound, scratch)
    return req.distinct, ranks(req.order, req.dup)


def ranks(order: np.ndarray, dup: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """The rank of each block position from the block's sort (:class:`SortedRequest`'s ``order``
    and ``dup``): one scatter, a piece at a time (no block-sized temporaries), into ``out`` when
    it is large enough (int32 below 2**31 keys)."""
    n = int(order.size)
    dtype = np.int32 if n < 1 << 31 else np.int64
    rank = out[:n] if out is not None and out.size >= n and out.dtype == dtype else np.empty(n, dtype=dtype)
    base = 0
    for c in range(0, n, _KEY_PIECE):
        d = min(n, c + _KEY_PIECE)
        if dup is None:
            rank[order[c:d]] = np.arange(c, d, dtype=rank.dtype)
        else:
            new = np.cumsum(~dup[c:d], dtype=rank.dtype)
            rank[order[c:d]] = new + (base - 1)
            base += int(new[-1])
    return rank


@dataclass(frozen=True, eq=False)
class BlockRead:
    """Block reader -> assembler: plan positions ``[start, stop)`` of ``segment`` are read into
    ``buffers`` (by batch; ``None`` when everything is cached), ``copies`` still to be copied in;
    with a :class:`SlotSink`, into sink slot ``slot`` in the order of ``keys`` (ascending)."""

    segment: Segment
    start: int
    stop: int
    keys: np.ndarray
    buffers: dict[int, BatchBuffer] | None
    copies: tuple[_Copy, ...] = ()
    slot: int | None = None
    #: A staged block: the batches are taken from its staging buffer (``buffers`` is ``None``).
    stage: _Stage | None = None
    #: Decode jobs still writing the block's rows (:attr:`Destination.decodes`): the assembler waits
    #: for them before it hands a batch over, so the reader goes on with the next block meanwhile.
    decodes: tuple[DecodeJob, ...] = ()

    @property
    def last(self) -> bool:
        """The segment's last block."""
        return self.stop == self.segment.length


@dataclass(frozen=True)
class EpochEnd:
    """Every block of epoch ``epoch`` was passed on; ``complete`` is False when the plan was cut
    short by ``limit`` (the epoch is not over after it)."""

    epoch: int
    complete: bool = True


@dataclass(frozen=True)
class RunDone:
    """The run's last segment was passed on; nothing follows."""


@dataclass(frozen=True, eq=False)
class BatchReady:
    """Assembler -> consumer: a batch, its epoch, the global position after it, and its buffer."""

    batch: dict[str, np.ndarray]
    epoch: int
    position: int
    buffer: BatchBuffer | None = None


class SlotSink(Protocol):
    """Where a pipeline that serves blocks puts them (see "Blocks into slots" above)."""

    def acquire(self, stop: threading.Event) -> tuple[int, np.ndarray]:
        """A free slot and its ``[K, *record_shape]`` payload array, blocking until there is one;
        raises :class:`~shardkit.stopping.Stopped` once ``stop`` is set."""
        ...


def assemble_batch(
    payload_name: str,
    payload: np.ndarray,
    fields: dict[str, np.ndarray],
    keys: np.ndarray,
) -> dict[str, np.ndarray]:
    """The batch dict: payload rows, every small field gathered by key, and ``key``."""
    batch = {payload_name: payload}
    for name, values in fields.items():
        batch[name] = values[keys]
    batch["key"] = np.array(keys, dtype=np.int64, copy=True)
    return batch


def gather_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """``dst[dst_rows] = src[src_rows]`` without a large temporary: consecutive destination rows in
    one ``np.take``, scattered ones a few rows at a time, or one by one when rows are large."""
    n = int(dst_rows.size)
    if n == 0:
        return
    r0 = int(dst_rows[0])
    if int(dst_rows[-1]) - r0 == n - 1 and np.all(np.diff(dst_rows) == 1):
        np.take(src, src_rows, axis=0, out=dst[r0 : r0 + n], mode="clip")
        return
    if src[0].nbytes >= _ROW_COPY_BYTES:
        for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
            dst[d] = src[s]
        return
    for a in range(0, n, _GATHER_ROWS):
        dst[dst_rows[a : a + _GATHER_ROWS]] = src[src_rows[a : a + _GATHER_ROWS]]


def _pinned_rows(cache: StaticCache, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(pos, row)``: the positions (ascending) of ``keys`` that ``cache`` pins, and their rows,
    looked up a piece of keys at a time (nothing block-sized but the hits)."""
    found: list[tuple[np.ndarray, np.ndarray]] = []
    for c in range(0, keys.size, _LOOKUP_PIECE):
        hit, row = cache.lookup(keys[c : c + _LOOKUP_PIECE])
        at = np.flatnonzero(hit)
        found.append((at + c, row[at].astype(np.int64, copy=False)))
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pos, crow = (np.concatenate(x) for x in zip(*found))
    return pos, crow


def reservoir_bounds(start: int, stop: int, first: int, largest: int, last: int | None = None) -> list[tuple[int, int]]:
    """The SSD reservoirs of plan positions ``[start, stop)``: ``first`` records, doubling up to
    ``largest``; with ``last`` the final ones halve back down to ``last`` records.

    The RAM tier reads reservoir r back while reservoir r + 1 is written, so only the final one's read
    overlaps nothing: at the end of a run a full reservoir left the disk idle for its whole read-back
    (a sixth of a first epoch of three reservoirs). Any partition into consecutive positions keeps
    the order (docs/design.md §4)."""
    first = max(1, int(first))
    largest = max(first, int(largest))
    if last is None:
        return list(block_bounds(start, stop, first, largest))
    tail: list[int] = []  # the final reservoirs' sizes, last first: last, 2 * last, ... up to largest
    size, room = min(largest, max(1, int(last))), (int(stop) - int(start)) // 2
    while size <= largest and sum(tail) + size <= room:
        tail.append(size)
        size *= 2
    hi = int(stop) - sum(tail)
    bounds = list(block_bounds(start, hi, first, largest))
    for size in reversed(tail):
        bounds.append((hi, hi + size))
        hi += size
    return bounds


def _block_keys(seg: Segment, bounds: list[tuple[int, int]], dtype: type[np.signedinteger[Any]], i: int) -> np.ndarray:
    """The keys of block ``i`` of ``bounds`` in pass ``seg``."""
    return seg.keys(*bounds[i], dtype)


class Pipeline:
    """Background threads for one run. Consumer side: :meth:`get`; teardown: :meth:`shutdown`.

    Parameters
    ----------
    source
        The datasets, opened here as one :class:`~shardkit.readers.sources.MixedDataset` with
        ``dataset_options`` (:meth:`SamplerOptions.dataset_options`).
    segments
        The run's :class:`Segment` objects, in order (consumed by the first creator).
    sizes, pool
        The memory plan (:class:`~shardkit.readers.options.TierSizes`) and the batch buffers.
    ssd_dir
        Parent of the run's private SSD directory (with the SSD tier).
    static_cache, node_disk
        Pinned records in RAM, and with ``locality`` on the node's disk, or ``None``.
    key_map
        Applied to every batch's ``key`` (global key -> key in its dataset); ``None`` keeps it.
    sink
        Read blocks into the sink's slots and pass them on instead of batches (no pool, no cache).
    identity
        Checked after every read from the disk tier, so no block of a replaced dataset is passed on.
    """

    def __init__(
        self,
        source: Mixture,
        segments: Iterator[Segment],
        *,
        fields: dict[str, np.ndarray],
        stats: SamplerStats,
        sizes: TierSizes,
        pool: BatchPool | None,
        ssd_dir: Path | None,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        dataset_options: Mapping[str, Any] | None = None,
        static_cache: StaticCache | None = None,
        node_disk: NodeDiskCache | None = None,
        identity: MixedIdentity | None = None,
        key_map: Callable[[np.ndarray], np.ndarray] | None = None,
        sink: SlotSink | None = None,
    ) -> None:
        if sink is not None and static_cache is not None:
            raise SamplerError("a pipeline that serves blocks into slots has no static cache (internal error)")
        if sink is None and pool is None:
            raise SamplerError("a pipeline that assembles batches needs a batch pool (internal error)")
        self.stop = threading.Event()
        self.sink = sink
        self.cache = static_cache
        self.node_disk = node_disk
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._stats = stats
        self._gap = gap_bytes
        self._fields = fields
        self._identity = identity
        self.disk = MixedDataset(source, stats=stats.disk, cache_stats=stats.remote_cache,
                                **{"gap_bytes": gap_bytes, **(dataset_options or {})})
        # A block read checks the stop flag between its pieces: closing does not wait for a whole block.
        self.disk.payload.stop_with(self.stop)
        self._key_map = key_map
        self._segments = segments
        self.sizes = sizes
        self.pool = pool
        #: The whole dataset is pinned: the reader fills the cache, the assembler takes buffers.
        self.assemble_only = static_cache is not None and static_cache.variant == "all"
        self.space: SsdSpace | None = None
        self.slots: ReservoirSlots | None = None
        self._blocks: queue.Queue[BlockRead | EpochEnd | RunDone] = queue.Queue(maxsize=1)
        self.batches: queue.Queue[BatchReady | BlockRead | EpochEnd | RunDone] = queue.Queue(maxsize=BATCH_PREFETCH)
        if sink is not None:
            self._blocks = self.batches  # type: ignore[assignment]  # no assembler: blocks go to the consumer
        self._ssd_q: queue.Queue[ReservoirWritten | EpochEnd | RunDone] = queue.Queue(maxsize=1)
        self._ssd_slots: queue.Queue[int] = queue.Queue()
        #: Staged blocks (sizes.staged, nothing pinned): two staging buffers, taken by the reader
        #: from ``_stage_free`` and given back by the assembler once the block's batches are taken.
        self.staged = sizes.staged and sink is None and static_cache is None
        self._stages: list[np.ndarray | None] = [None, None]
        #: The assembler's ranks of the block it takes batches from (reused: one block at a time).
        self._rank: np.ndarray | None = None
        self._stage_free: queue.Queue[int] = queue.Queue()
        for i in range(len(self._stages)):
            self._stage_free.put(i)
        #: The staged blocks' sort (the reader thread's; reused, so a block allocates no sort arrays).
        self._stage_sort = _StageSorts(sizes.ram_block)
        #: Blocks grow from a small first one (batches); a sink's blocks have one fixed size.
        self._first_block = self._grow = sink is None
        #: The mapped files: what the announcing thread announced of the block being read.
        self._announced: Lacking | None = None
        #: ``(epoch, bytes, calls)``: the dataset's read counters when the RAM reader last counted them.
        self._disk_mark: tuple[int, int, int] | None = None
        self._download_counted = False
        self._count_lock = threading.Lock()
        threads: list[tuple[str, Callable[[], None]]] = []
        if sizes.ssd_block is not None:
            assert ssd_dir is not None
            self.space = SsdSpace(ssd_dir)
            try:
                self.slots = ReservoirSlots(self.space, self.disk.payload, sizes.ssd_copy_bytes)
            except BaseException:
                self.space.close()
                raise
            for i in range(2):
                self._ssd_slots.put(i)
            threads += [("shardkit-ssd-creator", self._ssd_creator), ("shardkit-ram-creator", self._ram_from_ssd)]
        else:
            threads.append(("shardkit-ram-creator", self._ram_from_disk))
        if sink is None:
            threads.append(("shardkit-batch-creator", self._assembler))
        self.threads = [threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True) for name, fn in threads]
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------------ plumbing
    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Stopped:
            pass
        except BaseException as exc:
            if isinstance(exc, Exception):
                # A read that fails because the dataset is being replaced is reported as that.
                try:
                    self._verify()
                except SamplerError as changed:
                    changed.__cause__ = exc
                    exc = changed
                except Exception:  # the check itself failed (e.g. the store is unreachable): report the read's error
                    logger.debug("dataset identity check after a failed read also failed", exc_info=True)
            with self._error_lock:
                if self.error is None:
                    self.error = exc
            logger.debug("sampler thread %s failed", threading.current_thread().name, exc_info=True)
            self.stop.set()

    def _put(self, q: queue.Queue[Any], item: Any) -> None:
        stopping.put(q, item, self.stop)

    def _get(self, q: queue.Queue[Any]) -> Any:
        return stopping.get(q, self.stop)

    def _verify(self) -> None:
        """Stop the run if the dataset was replaced (after a read, before its data is passed on)."""
        if self._identity is not None:
            self._identity.check()

    def raise_error(self) -> None:
        """Re-raise a background failure in the consumer (ShardkitErrors as they are)."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, ShardkitError):
            raise exc
        raise SamplerError(f"background sample creator failed: {type(exc).__name__}: {exc}") from exc

    def get(self) -> BatchReady | BlockRead | EpochEnd | RunDone:
        """Next item for the consumer: a :class:`BatchReady` (a :class:`BlockRead` with a sink), an
        :class:`EpochEnd` or :class:`RunDone`."""
        while True:
            self.raise_error()
            try:
                return self.batches.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.stop.is_set():
                    self.raise_error()
                    raise SamplerError("sampler was shut down while the consumer waited for a batch") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every thread, delete the SSD directory, close files (idempotent, any thread)."""
        self.stop.set()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join(timeout)
                if t.is_alive():
                    logger.warning("sampler thread %s did not stop within %.0f s", t.name, timeout)
        if self._identity is not None:
            self._identity.cancel()
        if self.slots is not None:
            self.slots.close()
        if self.space is not None:
            self.space.close()
        self.disk.close()
        self._count_download()

    def _count_download(self) -> None:
        """Once the reader is closed (its downloads stopped): what reached the dataset's read
        counters after the last block (parts landing late) goes to the last epoch, and a download
        into a local cache adds its summary (:meth:`SamplerStats.add_download`)."""
        with self._count_lock:
            mark, self._disk_mark = self._disk_mark, None
            counted, self._download_counted = self._download_counted, True
        disk = self.disk.payload.stats
        if mark is not None and (disk.bytes_read > mark[1] or disk.read_calls > mark[2]):
            self._stats.add_epoch_disk(mark[0], disk.bytes_read - mark[1], disk.read_calls - mark[2])
        pf = getattr(self.disk.payload, "prefetcher", None)
        if not counted and pf is not None:
                st = pf.stats
                self._stats.add_download(st.parts_demanded + st.parts_background, st.bytes, st.reader_wait_s, st.cpu_s)

    # ------------------------------------------------------------------ blocks
    def _bounds(self, seg: Segment, start: int, stop: int, largest: int, span: int | None = None) -> Iterator[tuple[int, int]]:
        """The blocks of ``[start, stop)``: the run's very first block is small, then they grow
        (to ``largest`` at once after a block of ``span`` records, see :func:`block_bounds`)."""
        first = self.sizes.first_block if self._first_block else largest
        self._first_block = False
        return block_bounds(start, stop, min(first, largest), largest, span)

    def _read_block(
        self,
        seg: Segment,
        a: int,
        b: int,
        keys: np.ndarray,
        read: Callable[[np.ndarray, Destination], None],
        open_buffers: dict[int, BatchBuffer],
        tier: str = "disk",
        ahead: Ahead | None = None,
        opened: _Opened | None = None,
        then: Callable[[], None] | None = None,
    ) -> BlockRead:
        """Read plan positions ``[a, b)`` (``keys``) with ``read(keys, destination)``: uncached records
        into their batch rows (or a sink slot), pinned ones the cache lacks into their cache rows.
        ``open_buffers`` carries a batch an earlier block began into the next block; ``ahead`` is
        what :meth:`_expect` announced for these keys; ``opened``, the block's buffers and destination
        when it was opened ahead (:meth:`_open_ahead`); ``then``, called once the block holds its
        buffers, before its read (it opens the blocks after it)."""
        if self.sink is not None:
            ring_slot, array = self.sink.acquire(self.stop)
            keys = np.sort(keys)
            self._timed_read(read, keys, Destination.rows_of(array, keys.size), tier)
            return BlockRead(seg, a, b, keys, None, slot=ring_slot)
        if self.staged:
            return self._read_staged(seg, a, b, keys, read, tier)
        if self.assemble_only and (mapped := self._mapped()) is not None:
            # The whole dataset is pinned as its mapped files: make the block's pages resident, and
            # the assembler copies every batch from them.
            t0, c0 = time.perf_counter(), time.thread_time()
            # Announced ahead on the announcing thread (AnnounceAhead), but for the run's first
            # block, which populate announces itself: its first batch waits for nothing else.
            announced, self._announced = self._announced, None
            mapped.populate(keys, self.disk.payload.stats, self.stop, node=self.cache, announced=announced)
            self._stats.add_busy(tier, time.perf_counter() - t0)
            self._stats.add_busy(f"{tier}_cpu", time.thread_time() - c0)
            views = mapped.copies(keys)
            return BlockRead(seg, a, b, keys, None, tuple(_Copy(p, v, r, cached=True) for p, v, r in views))
        bs = seg.shape.batch_size
        buffers: dict[int, BatchBuffer] | None = None
        if opened is not None:
            buffers = opened.buffers
        elif not self.assemble_only:
            buffers = {}
            for g in range(a // bs, (b - 1) // bs + 1):
                buf = open_buffers.pop(g, None)
                buffers[g] = buf if buf is not None else self._pool().acquire(self.stop)
        if buffers is not None:
            last = (b - 1) // bs
            if int(seg.shape.batch_sizes[last]) > b - last * bs:  # the last batch continues in the next block
                open_buffers[last] = buffers[last]
        if self.cache is None and buffers is not None:
            # Nothing pinned: every record straight into its batch row (no per-record cache arrays).
            dest = opened.dest if opened is not None else self._batch_destination(seg, a, b, buffers)
            if then is not None:
                then()
            self._timed_read(read, keys, dest, tier)
            return BlockRead(seg, a, b, keys, buffers, decodes=tuple(dest.decodes or ()))
        pos, crow, fill = self._cache_plan(keys, ahead)
        copies: list[_Copy] = []
        if pos.size:  # served from the cache rows, those the block fills included
            assert self.cache is not None and self.cache.rows is not None
            copies.append(_Copy(pos, self.cache.rows, crow, cached=True))
        served = ~fill
        # Block positions to read (None: all of them, no position array), and where in them the
        # records that fill the cache are (as indices into what is read).
        wanted: np.ndarray | None = None
        if served.any():
            keep = np.ones(b - a, dtype=bool)
            keep[pos[served]] = False
            wanted = np.flatnonzero(keep)
            del keep
        count = b - a if wanted is None else int(wanted.size)
        fill_rows = crow[fill] if fill.any() else None
        to_cache: np.ndarray | None = None
        if fill_rows is not None:
            to_cache = pos[fill] if wanted is None else np.searchsorted(wanted, pos[fill])
        del pos, crow, served
        if count:
            arrays: list[np.ndarray] = []
            if to_cache is not None:
                assert self.cache is not None and self.cache.rows is not None and fill_rows is not None
                arrays.append(self.cache.rows)
            if buffers is not None:
                # Buffer and row as int32 (as without a cache), from the block's offset in its first batch.
                which, rows = self._batch_rows(seg, a, wanted, count)
                if to_cache is not None:
                    which += np.int32(1)  # the cache rows are buffer 0
                arrays += [buffers[g].array for g in range(a // bs, a // bs + len(buffers))]
            else:
                # Everything is pinned, but some rows found no memory on the node: read them into a
                # block of their own, and the assembler copies them like cache rows.
                assert self.pool is not None
                direct_mask = np.ones(count, dtype=bool)
                if to_cache is not None:
                    direct_mask[to_cache] = False
                direct = np.flatnonzero(direct_mask)
                spill_at = direct if wanted is None else wanted[direct]
                if direct.size:
                    spill = aligned_empty(direct.size, self.pool.record_shape, self.pool.dtype)
                    copies.append(_Copy(spill_at, spill, np.arange(direct.size)))
                    arrays.append(spill)
                which = np.full(count, len(arrays) - 1, dtype=np.int32)
                rows = np.zeros(count, dtype=np.int32)
                rows[direct] = np.arange(direct.size, dtype=np.int32)
            if to_cache is not None:
                assert fill_rows is not None
                which[to_cache], rows[to_cache] = 0, fill_rows
            self._timed_read(read, keys if wanted is None else keys[wanted], Destination(tuple(arrays), which, rows), tier)
            if self.cache is not None and fill_rows is not None:
                self.cache.publish(fill_rows)
        return BlockRead(seg, a, b, keys, buffers, tuple(copies))

    @staticmethod
    def _batch_rows(seg: Segment, a: int, wanted: np.ndarray | None, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch buffer (relative to the block's first batch) and row of block positions ``wanted``
        (``None``: all ``count`` of them) of a block starting at plan position ``a``, as int32 (fewer
        than 2**31 batches and rows): 8 bytes a block record, no int64 temporaries."""
        bs = seg.shape.batch_size
        offset = a - (a // bs) * bs  # the block's offset in its first batch
        if wanted is None:
            which = np.arange(offset, offset + count, dtype=np.int32)
        else:
            which = wanted.astype(np.int32)
            which += np.int32(offset)
        rows = which % np.int32(bs)
        which //= np.int32(bs)
        return which, rows

    def _read_staged(self, seg: Segment, a: int, b: int, keys: np.ndarray,
                     read: Callable[[np.ndarray, Destination], None], tier: str) -> BlockRead:
        """Read plan positions ``[a, b)`` (``keys``) into a staging buffer: the distinct keys in
        ascending order, so the read fills consecutive rows (no scatter into hundreds of batch
        buffers); the assembler takes each batch from it by rank."""
        t0 = time.perf_counter()
        slot = self._get(self._stage_free)
        self._stats.add_wait("stage", time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.thread_time()
        # The sort's order and duplicate flags are the slot's (the assembler ranks the block from
        # them, off the reader, the busier thread), so the next block's sort does not overwrite them.
        self._stage_sort.slot = slot
        req = SortedRequest.of(keys, self.disk.num_records, self._stage_sort)
        distinct, m = req.distinct, int(req.distinct.size)
        order, dup = req.order, req.dup
        stage = self._stages[slot]
        if stage is None or stage.shape[0] < m:
            pool = self._pool()
            self._stages[slot] = None
            del stage  # the smaller buffer goes before the larger one is mapped
            # Blocks grow to ram_block: a staging buffer is allocated at most a few times a run.
            stage = self._stages[slot] = aligned_empty(max(m, min(2 * m, self.sizes.ram_block)),
                                                       pool.record_shape, pool.dtype)  # fmt: skip
        read(distinct, Destination.rows_of(stage[:m], m))
        self._stats.add_busy(tier, time.perf_counter() - t0)
        self._stats.add_busy(f"{tier}_cpu", time.thread_time() - c0)
        return BlockRead(seg, a, b, keys, None, stage=_Stage(slot, byte_records(stage[:m]), order, dup))

    def _timed_read(self, read: Callable[[np.ndarray, Destination], None], keys: np.ndarray,
                    dest: Destination, tier: str) -> None:
        """``read(keys, dest)``, its time counted as ``tier``'s busy (and CPU) time."""
        t0, c0 = time.perf_counter(), time.thread_time()
        read(keys, dest)
        self._stats.add_busy(tier, time.perf_counter() - t0)
        self._stats.add_busy(f"{tier}_cpu", time.thread_time() - c0)

    def _mapped(self) -> MappedShards | None:
        """The static cache as the dataset's mapped shard files (:class:`MappedShards`), mapped on
        first use; ``None`` when it is not one (it then attaches rows of its own)."""
        cache = self.cache
        if cache is None or not cache.files:
            return None
        if cache.mapped is None:
            payload = self.disk.payload
            mapped = MappedShards.open(payload) if isinstance(payload, PayloadArray) and self.node_disk is None else None
            if mapped is None:
                logger.info("static cache: the shard files cannot be mapped; keeping a copy of the records")
                cache.keep_rows()
                return None
            cache.mapped = mapped
        cache.attach()  # the flags of what the node made resident
        return cache.mapped

    def _expect(self, keys: np.ndarray) -> Ahead | None:
        """Announce the next block (``keys``) to the cache: the rows it will fill get their memory
        on the cache's allocation thread while this block is read (:meth:`StaticCache.expect`)."""
        if self.cache is None or self.cache.share_key is None or self.cache.files:
            return None  # (the mapped files have no rows to allocate)
        _, crow = _pinned_rows(self.cache, keys)  # attaches the cache on first use
        if not self.cache.shared or not crow.size:
            return None
        crow = crow[~self.cache.filled(crow)]
        return self.cache.expect(crow) if crow.size else None

    def _cache_plan(self, keys: np.ndarray, ahead: Ahead | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pos, row, fill)`` for a block's keys: the positions (ascending) of those the cache
        serves (pinned and with memory on the node), their cache rows, and which of them the block
        must read first. Looked up a piece of keys at a time and kept for the hits only: a block of
        small records holds millions of keys and a small cache pins few of them, so nothing here
        is block-sized but the hits (docs/design.md §4, *Memory per record*). ``ahead``: the rows
        were announced (:meth:`_expect`)."""
        if self.cache is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        pos, crow = _pinned_rows(self.cache, keys)
        fill = ~self.cache.filled(crow) if pos.size else np.zeros(0, dtype=bool)
        if fill.any():
            # Rows the node has no memory for are read like uncached records.
            spare = np.flatnonzero(fill)[~self.cache.reserve(crow[fill], ahead)]
            if spare.size:
                keep = np.ones(pos.size, dtype=bool)
                keep[spare] = False
                pos, crow, fill = pos[keep], crow[keep], fill[keep]
        return pos, crow, fill

    def _ram_from_disk(self) -> None:
        """Disk -> batch buffers: each block of the plan read in ascending offsets."""
        read: Callable[[np.ndarray, Destination], None] = self.disk.payload.read_into
        if self.node_disk is not None:  # locality: the node's records on its disk come from there
            assert isinstance(self.disk.payload, PayloadArray)  # locality: one dataset's own payload (sampler)
            read = self.node_disk.reader(self.disk.payload, self.stop)
        # A reader that can start the next block's requests early (object store, no cache) is told
        # the next block's keys the static cache does not pin (pinned ones may need no read).
        ahead = getattr(self.disk.payload, "read_ahead", None) if self.node_disk is None else None
        # A reader that downloads into a local cache (object store) is told the epoch's block
        # schedule up front, to download parts in the order the blocks will need them.
        schedule = getattr(self.disk.payload, "schedule", None) if self.node_disk is None else None
        mapped = self._mapped() if self.assemble_only else None  # decided before any block is announced
        # A reader that downloads into a local cache can take later blocks' rows before their reads
        # (docs/design.md §9, *Blocks that complete during the download*).
        deliver_ahead = getattr(self.disk.payload, "deliver_ahead", None) if self._opens_ahead() else None
        # A staged block's keys go to its sort, its batches' keys and a read-ahead hint (which copies
        # them): int32 when they fit (STAGED_RECORD_BYTES, docs/design.md §4).
        dtype = np.int32 if self.staged and self.disk.num_records <= 1 << 31 else np.int64
        # The mapped files' blocks are announced ahead on a thread of their own (AnnounceAhead).
        announcer = AnnounceAhead(mapped) if mapped is not None else None
        started = False  # whether the run's first block was read
        try:
            for seg in self._segments:
                open_buffers: dict[int, BatchBuffer] = {}
                self._count_epoch_disk(seg.epoch, block=False)  # what landed since the last block: the epoch before
                bounds = list(self._bounds(seg, 0, seg.length, self.sizes.ram_block, self.sizes.span_block))
                if schedule is not None:
                    schedule(self._unpinned(seg.keys(a, b)) for a, b in bounds)
                opening = _Opening(seg, bounds, deliver_ahead) if deliver_ahead is not None else None
                opened: dict[int, _Opened] = opening.blocks if opening is not None else {}
                if announcer is not None:
                    announcer.start_pass(functools.partial(_block_keys, seg, bounds, dtype), len(bounds))
                following: np.ndarray | None = None
                announced: Ahead | None = None
                for i, (a, b) in enumerate(bounds):
                    upcoming = bounds[i + 1] if i + 1 < len(bounds) else None
                    mine = opened.pop(i, None)
                    this, announced = announced, None
                    if announcer is not None and started:  # (the run's first block: populate announces it)
                        keys, self._announced = announcer.take(i, self.stop)
                    else:
                        keys = mine.keys if mine is not None else following if following is not None else seg.keys(a, b, dtype)
                    following = None
                    if announcer is None and upcoming is not None and (ahead is not None
                                                   or (self.cache is not None and self.cache.share_key is not None)):  # fmt: skip
                        following = opened[i + 1].keys if i + 1 in opened else seg.keys(*upcoming, dtype)
                        if ahead is not None:
                            ahead(self._unpinned(following))
                        # The next block's cache rows are allocated on the cache's thread while this one is read.
                        announced = self._expect(following)
                    then: Callable[[], None] | None = None
                    if opening is not None and opening.active and i:  # (the first block first: its batch is awaited)
                        then = functools.partial(self._open_ahead, opening, i)
                    if self._identity is not None:  # a check that is due runs while the block is read
                        self._identity.check(wait=False)
                    block = self._read_block(seg, a, b, keys, read, open_buffers, ahead=this, opened=mine,
                                             then=then)  # fmt: skip
                    started = True
                    self._verify()
                    self._count_epoch_disk(seg.epoch)
                    self._put(self._blocks, block)
                seg.done()
                self._put(self._blocks, EpochEnd(seg.epoch, seg.complete))
            self._put(self._blocks, RunDone())
        finally:
            if announcer is not None:
                announcer.close()

    def _opens_ahead(self) -> bool:
        """Whether blocks may be opened ahead (:meth:`_open_ahead`): batch buffers read straight
        from the dataset (no static cache, staging, sink or node-local reader)."""
        return (self.sink is None and self.cache is None and not self.staged and not self.assemble_only
                and self.node_disk is None and self.pool is not None)  # fmt: skip

    def _open_ahead(self, opening: _Opening, i: int) -> None:
        """Once block ``i`` holds its buffers, before it is read, open the blocks after it that the
        pool has free buffers for now (in order, whole blocks, without waiting for the consumer:
        a block read later never waits for buffers a block after it holds), while the reader still has
        records to download (``deliver_ahead`` says so): their rows are the reader's from then on,
        so the download copies their records in as their bytes land, and the blocks complete when
        it does instead of being read back from the copies after it (docs/design.md §9). Only
        blocks that start a batch are opened (no batch is shared with a block not opened yet).
        Once the reader has nothing left to download, no more block of the pass is opened."""
        pool = self._pool()
        seg, bounds, opened = opening.seg, opening.bounds, opening.blocks
        bs = seg.shape.batch_size
        j = max(opened, default=i) + 1
        while j < len(bounds):
            a, b = bounds[j]
            if a % bs:
                return
            batches = range(a // bs, (b - 1) // bs + 1)
            taken: list[BatchBuffer] = []
            for _ in batches:
                buf = pool.try_acquire()
                if buf is None:
                    for t in taken:
                        pool.release(t)
                    return
                taken.append(buf)
            buffers = dict(zip(batches, taken))
            keys = seg.keys(a, b)
            dest = self._batch_destination(seg, a, b, buffers)
            if not opening.deliver(keys, dest):  # nothing left to download: read as usual from here on
                for t in taken:
                    pool.release(t)
                opening.active = False
                return
            opened[j] = _Opened(keys, buffers, dest)
            j += 1

    @staticmethod
    def _batch_destination(seg: Segment, a: int, b: int, buffers: dict[int, BatchBuffer]) -> Destination:
        """Every record of plan positions ``[a, b)`` straight into its row of the block's batch
        ``buffers`` (nothing pinned: no per-record cache arrays)."""
        bs = seg.shape.batch_size
        which, rows = Pipeline._batch_rows(seg, a, None, b - a)
        batch_arrays = tuple(buffers[g].array for g in range(a // bs, a // bs + len(buffers)))
        return Destination(batch_arrays, which, rows, (a - (a // bs) * bs, bs), decodes=[])

    def _count_epoch_disk(self, epoch: int, *, block: bool = True) -> None:
        """Count what the dataset's read counters gained since the last count (every byte and
        request, also those a background download made between blocks) for the epoch then being
        read, and read ``epoch`` from now on; after a ``block`` the count is made even when nothing
        was read (the epoch is listed)."""
        disk = self.disk.payload.stats
        with self._count_lock:
            mark = self._disk_mark
            nbytes, calls = disk.bytes_read, disk.read_calls
            self._disk_mark = (epoch, nbytes, calls)
        if mark is not None and (block or nbytes > mark[1] or calls > mark[2]):
            self._stats.add_epoch_disk(mark[0], nbytes - mark[1], calls - mark[2])

    def _unpinned(self, keys: np.ndarray) -> np.ndarray:
        """``keys`` the static cache does not pin (pinned ones may need no read)."""
        return keys if self.cache is None else keys[~self.cache.lookup(keys)[0]]

    # ------------------------------------------------------------------ SSD tier
    def _ssd_creator(self) -> None:
        """Disk -> SSD: reservoirs of consecutive plan positions, written in ascending key order;
        pinned records the cache lacks go straight into their cache rows, never to SSD."""
        assert self.slots is not None and self.sizes.ssd_block is not None
        first, turn = self._grow, 0
        for seg in self._segments:
            size = self.sizes.first_block if first else self.sizes.ssd_block
            first = False
            # The run's end shrinks; a sink's reservoirs have one fixed size (serve's order is defined by it).
            last = self.sizes.first_block if seg.last and self._grow else None
            bounds = reservoir_bounds(0, seg.length, min(size, self.sizes.ssd_block), self.sizes.ssd_block, last)
            # The slots take turns: each is allocated ahead of the writes, as far as its reservoirs need.
            rec = self.disk.record_nbytes
            self.slots.preallocate(((turn + i) % 2, (b - a) * rec) for i, (a, b) in enumerate(bounds))
            turn += len(bounds)
            pending: _Filling | None = None
            following: np.ndarray | None = None
            for i, (a, b) in enumerate(bounds):
                keys = following if following is not None else seg.keys(a, b)
                following = seg.keys(*bounds[i + 1]) if i + 1 < len(bounds) else None
                # The next reservoir's records the cache does not pin: read ahead while this one's last chunk is copied.
                self.slots.expect(None if following is None else distinct_sorted(self._unpinned(following)))
                slot = self._free_slot()
                if slot is None:  # the RAM tier still reads both: pass the reservoir in flight on first
                    self._fill_done(pending)
                    pending = None
                    t0 = time.perf_counter()
                    slot = self._get(self._ssd_slots)
                    self._stats.add_wait("ssd_fill", time.perf_counter() - t0)
                before, calls = self.disk.payload.stats.bytes_read, self.disk.payload.stats.read_calls
                pos, crow, fill = self._cache_plan(keys)
                if fill.any():
                    assert self.cache is not None and self.cache.rows is not None
                    dest = Destination((self.cache.rows,), np.zeros(int(fill.sum()), np.int64), crow[fill])
                    t0 = time.perf_counter()
                    self.disk.payload.read_into(keys[pos[fill]], dest)
                    self._stats.add_busy("disk", time.perf_counter() - t0)
                    self._verify()
                    self.cache.publish(crow[fill])
                self._stats.add_epoch_disk(seg.epoch, self.disk.payload.stats.bytes_read - before,
                                           self.disk.payload.stats.read_calls - calls)
                stored = distinct_sorted(np.delete(keys, pos) if pos.size else keys)
                # The run's last reservoirs halve: once they do, a slot read back need only hold the
                # largest one it gets later (the two slots take turns); not while they grow (the
                # slots' preallocation is still under way).
                left = max((d - c for c, d in bounds[i + 2 :: 2]), default=0)
                keep = left if seg.last and left < b - a else None
                t0 = time.perf_counter()
                write = self.slots.start(slot, self.disk.payload, stored, self.stop) if stored.size else None
                self._stats.add_busy("ssd_fill", time.perf_counter() - t0)
                # The reservoir before this one is passed on once its reads end; this one's are in
                # flight meanwhile, so the device has the next requests queued when those end.
                self._fill_done(pending)
                pending = _Filling(ReservoirWritten(seg, a, b, keys, stored, slot, keep), write)
                if write is None or not write.in_flight:  # a copy: made now, one reservoir at a time
                    self._fill_done(pending)
                    pending = None
            self._fill_done(pending)
            pending = None
            seg.done()
            self._put(self._ssd_q, EpochEnd(seg.epoch, seg.complete))
        self._put(self._ssd_q, RunDone())

    def _free_slot(self) -> int | None:
        """A slot the RAM tier has read back, or ``None`` when it still reads both."""
        try:
            return self._ssd_slots.get_nowait()
        except queue.Empty:
            return None

    def _fill_done(self, filling: _Filling | None) -> None:
        """Complete ``filling``'s write (wait for its reads, or make its copy), count it, and pass its
        reservoir on to the RAM tier."""
        if filling is None:
            return
        assert self.slots is not None
        item, write = filling.item, filling.write
        if write is not None:
            before, calls = self.disk.payload.stats.bytes_read, self.disk.payload.stats.read_calls
            t0 = time.perf_counter()
            self._stats.add_written(self.slots.finish(write))
            self._stats.add_busy("ssd_fill", time.perf_counter() - t0)
            self._verify()
            self._stats.add_epoch_disk(item.segment.epoch, self.disk.payload.stats.bytes_read - before,
                                       self.disk.payload.stats.read_calls - calls)
        self._put(self._ssd_q, item)

    def _pool(self) -> BatchPool:
        assert self.pool is not None
        return self.pool

    def _ram_from_ssd(self) -> None:
        """SSD -> batch buffers: blocks inside each reservoir, read in ascending offsets."""
        open_buffers: dict[int, BatchBuffer] = {}
        seg: Segment | None = None
        while True:
            t0 = time.perf_counter()
            item = self._get(self._ssd_q)
            self._stats.add_wait("ssd", time.perf_counter() - t0)
            match item:
                case ReservoirWritten() as res:
                    if res.segment is not seg:
                        seg, open_buffers = res.segment, {}
                    self._blocks_of_reservoir(res, open_buffers)
                case RunDone() as done:
                    self._put(self._blocks, done)
                    return
                case other:
                    self._put(self._blocks, other)

    def _blocks_of_reservoir(self, item: ReservoirWritten, open_buffers: dict[int, BatchBuffer]) -> None:
        """Pass one SSD reservoir on as blocks, then free its slot (rewritten by a later reservoir);
        at the run's end, cut to what the later reservoirs need, so its pages are freed here, while
        the last batches are delivered, rather than all at once when the run closes."""
        assert self.slots is not None
        res = self.slots.records(item.slot, item.stored.size, self._stats.ssd, self._gap) if item.stored.size else None

        def read(keys: np.ndarray, dest: Destination) -> None:
            if res is None:  # every key is in the cache (already filled by the SSD creator)
                raise SamplerError("SSD reservoir missing for uncached records (internal error)")
            res.read_into(np.searchsorted(item.stored, keys), dest)

        for a, b in self._bounds(item.segment, item.start, item.stop, self.sizes.ram_block):
            keys = item.keys[a - item.start : b - item.start]
            self._put(self._blocks, self._read_block(item.segment, a, b, keys, read, open_buffers, "ssd"))
        if item.keep is not None:
            self.slots.shrink(item.slot, item.keep * self.disk.record_nbytes)
        self._ssd_slots.put(item.slot)

    # ------------------------------------------------------------------ batches
    def _assembler(self) -> None:
        """Blocks -> batches: pinned rows copied from the cache, every batch handed over as soon as
        its last record is in place (a batch may span two blocks)."""
        seg: Segment | None = None
        open_batches: dict[int, _OpenBatch] = {}
        while True:
            match self._get(self._blocks):
                case RunDone() as done:
                    self._put(self.batches, done)
                    return
                case EpochEnd() as end:
                    self._put(self.batches, end)
                    seg, open_batches = None, {}
                case BlockRead() as block:
                    if block.segment is not seg:
                        seg, open_batches = block.segment, {}
                    self._batches_of_block(block, open_batches)

    def _batches_of_block(self, block: BlockRead, open_batches: dict[int, _OpenBatch]) -> None:
        seg, a, b = block.segment, block.start, block.stop
        if block.decodes:  # the block's records still being decoded into its batch rows
            t0 = time.perf_counter()
            finish_decodes(list(block.decodes))
            self._stats.add_wait("decode", time.perf_counter() - t0)
        bs = seg.shape.batch_size
        rec = self.disk.record_nbytes
        rank: np.ndarray | None = None
        if block.stage is not None:
            t0 = time.perf_counter()
            rank = self._rank = ranks(block.stage.order, block.stage.dup, self._rank)
            self._stats.add_busy("assembly", time.perf_counter() - t0)
        for g in range(a // bs, (b - 1) // bs + 1):
            g0, size = g * bs, int(seg.shape.batch_sizes[g])
            lo, hi = max(a, g0), min(b, g0 + size)
            part = open_batches.pop(g, None)
            if block.buffers is not None:
                buf = block.buffers[g]
            else:
                buf = part.buffer if part is not None else self._pool().acquire(self.stop)
            t0 = time.perf_counter()  # assembly time: not the waits for a buffer or for the consumer
            if block.stage is not None and rank is not None:  # one take of the batch's rows from the staging buffer
                np.take(block.stage.records, rank[lo - a : hi - a], axis=0,
                        out=byte_records(buf.array)[lo - g0 : hi - g0], mode="clip")  # fmt: skip
            keys = block.keys[lo - a : hi - a]
            if part is not None:
                keys = np.concatenate([part.keys, keys])
            for copy in block.copies:
                positions = copy.positions + a  # plan positions
                sel = slice(*np.searchsorted(positions, [lo, hi]))
                if sel.stop > sel.start:
                    gather_rows(buf.array, positions[sel] - g0, copy.source, copy.rows[sel])
                    if copy.cached:
                        count = sel.stop - sel.start
                        self._stats.cache.add("static-cache", 0, count * rec)
                        self._stats.cache.add_records(count)
            if g0 + size > b:
                open_batches[g] = _OpenBatch(buf, keys)  # completed by the next block
                self._stats.add_busy("assembly", time.perf_counter() - t0)
                continue
            batch = assemble_batch(self.disk.payload_name, buf.array[:size], self._fields, keys)
            if self._key_map is not None:
                batch["key"] = self._key_map(batch["key"])  # global key -> the record's key in its dataset
            self._stats.ram.add("ram", g0, size * rec)
            self._stats.ram.add_records(size)
            self._stats.add_busy("assembly", time.perf_counter() - t0)
            self._put(self.batches, BatchReady(batch, seg.epoch, int(seg.shape.positions[g]), buf))
        if block.stage is not None:
            self._stage_free.put(block.stage.slot)  # every batch taken: the reader may refill it


@dataclass(frozen=True, eq=False)
class _Filling:
    """A reservoir the SSD creator is writing (``write``, ``None`` when every record is pinned),
    passed on as ``item`` once written (:meth:`Pipeline._fill_done`)."""

    item: ReservoirWritten
    write: SlotWrite | None


@dataclass(frozen=True, eq=False)
class _Opened:
    """A block opened ahead of its read (:meth:`Pipeline._open_ahead`): its keys, its batch
    buffers and the destination its read will be given (the same object the reader was told)."""

    keys: np.ndarray
    buffers: dict[int, BatchBuffer]
    dest: Destination


@dataclass(eq=False)
class _Opening:
    """The blocks of one pass (``bounds`` of ``seg``) the reader opened ahead, by index, and the
    reader's ``deliver`` (:meth:`~shardkit.formats.ranged.RangedPayloadArray.deliver_ahead`);
    ``active`` until the reader says it has nothing left to download."""

    seg: Segment
    bounds: list[tuple[int, int]]
    deliver: Callable[[np.ndarray, Destination], bool]
    blocks: dict[int, _Opened] = field(default_factory=dict)
    active: bool = True


@dataclass(frozen=True, eq=False)
class _OpenBatch:
    """A batch the assembler began with one block and completes with the next."""

    buffer: BatchBuffer
    keys: np.ndarray
