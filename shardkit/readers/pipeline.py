"""The background half of the tiered sampler: sample creators and the batch creator as threads.

One run (one iteration over the sampler) owns one :class:`Pipeline`::

    plans ─▶ [ssd creator] ─ssd_q─▶ [ram creator] ─ready_q─▶ [batch creator] ─batch_q─▶ consumer
              disk → SSD            SSD/disk → RAM            RAM → batches
              (optional)            2 RAM buffers             copies, fields by key

Every queue is bounded, and the two RAM buffers (and two SSD reservoir slots) circulate through
"free" queues, so each tier is double-buffered: while the consumer drains block ``b`` the creator
fills block ``b + 1``. What travels on the queues are small frozen values (:class:`ReservoirWritten`,
:class:`BlockFilled`, :class:`EpochEnd`, :class:`RunDone`, :class:`BatchReady`). Blocking calls go
through :mod:`shardkit.readers.stopping`, so a run that is abandoned (break, exception, Ctrl-C,
garbage collection) stops within about a tenth of a second plus one in-flight read.

Why threads and not processes: ``preadv``, ``os.write`` and numpy copies release the GIL, so
threads overlap I/O with the consumer's Python code while sharing the RAM buffers with zero copies;
processes would have to hand payload over through shared memory, and buy nothing measurable (see
the Sampler section of ``benchmarks/RESULTS.md`` for the measurement).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.errors import SamplerError, ShardkitError
from shardkit.formats import DEFAULT_GAP_BYTES, Dataset
from shardkit.readers import stopping
from shardkit.readers.identity import DatasetIdentity
from shardkit.readers.schedule import BATCH_PREFETCH, ConsumerPlan
from shardkit.readers.ssd import SsdSpace, write_reservoir
from shardkit.readers.static_cache import StaticCache
from shardkit.readers.stats import SamplerStats
from shardkit.readers.stopping import POLL_SECONDS, Stopped

__all__ = [
    "Segment",
    "ReservoirWritten",
    "BlockFilled",
    "EpochEnd",
    "RunDone",
    "BatchReady",
    "Pipeline",
    "assemble_batch",
    "POLL_SECONDS",
    "BATCH_PREFETCH",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Segment:
    """One epoch's share of a consumer: its plan (keys, batch sizes, positions) and epoch number."""

    epoch: int
    plan: ConsumerPlan
    #: False when the plan was cut short by ``limit`` (the epoch is not over after it).
    complete: bool = True
    batch_starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts = np.concatenate(([0], np.cumsum(self.plan.batch_sizes)[:-1])).astype(np.int64)
        object.__setattr__(self, "batch_starts", starts)

    @property
    def keys(self) -> np.ndarray:
        return self.plan.keys


# Items that travel between the threads (see the module docstring's diagram).
@dataclass(frozen=True, eq=False)
class ReservoirWritten:
    """SSD creator -> RAM creator: reservoir of plan positions ``[start, start + K1)`` of ``segment``
    is on SSD at ``path`` (``None`` when all its keys are pinned in the static cache), in ``slot``."""

    segment: Segment
    start: int
    path: Path | None
    slot: int


@dataclass(frozen=True, eq=False)
class BlockFilled:
    """RAM creator -> batch creator: RAM buffer ``buffer`` holds the ``count`` records of plan
    positions ``[start, start + count)``; plan position ``start + j`` is row ``rows[j]`` (row ``j``
    when ``rows`` is ``None``)."""

    segment: Segment
    start: int
    count: int
    buffer: int
    rows: np.ndarray | None


@dataclass(frozen=True, eq=False)
class EpochEnd:
    """Every block of ``segment`` was passed on."""

    segment: Segment


@dataclass(frozen=True)
class RunDone:
    """The run's last segment was passed on; nothing follows."""


@dataclass(frozen=True, eq=False)
class BatchReady:
    """Batch creator -> consumer: a batch, its epoch and the global position after it."""

    batch: dict[str, np.ndarray]
    epoch: int
    position: int


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


class Pipeline:
    """Background creators for one run. Consumer side: :meth:`get`; teardown: :meth:`shutdown`.

    Parameters
    ----------
    dataset_path
        The dataset (disk tier: a local directory or an object-store URL); opened here with the disk
        tier's counters and ``dataset_options`` (:meth:`SamplerOptions.dataset_options`: the remote
        gap threshold, concurrency and local cache of an object store).
    segments
        Iterator of the run's :class:`Segment` objects, in order (consumed by the first creator).
    ram_block
        K2, records per RAM block.
    ssd_block
        K1, records per SSD reservoir, or ``None`` without the SSD tier.
    ssd_dir
        Parent of the run's private SSD directory.
    static_cache
        Pinned records (see :mod:`shardkit.readers.static_cache`), or ``None``. Loaded by the first
        creator before its first read; pinned keys of a block are then copied from it and only the
        unpinned ones are read from disk (or from the SSD reservoir, which holds only those).
    identity
        The dataset's identity when the sampler opened it, checked after every read from the disk
        tier (see :mod:`shardkit.readers.identity`), so no block read from a replaced dataset is
        ever passed on.
    """

    def __init__(
        self,
        dataset_path: Path | str,
        segments: Iterator[Segment],
        *,
        fields: dict[str, np.ndarray],
        stats: SamplerStats,
        ram_block: int,
        ssd_block: int | None,
        ssd_dir: Path | None,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        dataset_options: Mapping[str, Any] | None = None,
        static_cache: StaticCache | None = None,
        identity: DatasetIdentity | None = None,
    ) -> None:
        self.stop = threading.Event()
        self.cache = static_cache
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._stats = stats
        self._gap = gap_bytes
        self._fields = fields
        self._identity = identity
        self.disk = Dataset(dataset_path, stats=stats.disk, cache_stats=stats.remote_cache,
                            **{"gap_bytes": gap_bytes, **(dataset_options or {})})
        self._payload_name = self.disk.payload_name
        self._segments = segments
        self.ram_block = int(ram_block)
        self.ssd_block = None if ssd_block is None else int(ssd_block)
        self.space: SsdSpace | None = None
        self._buffers = [self.disk.payload.empty(self.ram_block) for _ in range(2)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self._buffers)):
            self._free.put(i)
        self._ready: queue.Queue[BlockFilled | EpochEnd | RunDone] = queue.Queue(maxsize=2)
        self.batches: queue.Queue[BatchReady | EpochEnd | RunDone] = queue.Queue(maxsize=BATCH_PREFETCH)
        self._ssd_q: queue.Queue[ReservoirWritten | EpochEnd | RunDone] = queue.Queue(maxsize=2)
        self._ssd_slots: queue.Queue[int] = queue.Queue()
        threads: list[tuple[str, Callable[[], None]]] = []
        if self.ssd_block is not None:
            assert ssd_dir is not None
            self.space = SsdSpace(ssd_dir)
            for i in range(2):
                self._ssd_slots.put(i)
            threads.append(("shardkit-ssd-creator", self._ssd_creator))
            threads.append(("shardkit-ram-creator", self._ram_from_ssd))
        else:
            threads.append(("shardkit-ram-creator", self._ram_from_disk))
        threads.append(("shardkit-batch-creator", self._batch_creator))
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

    def get(self) -> BatchReady | EpochEnd | RunDone:
        """Next item for the consumer: a :class:`BatchReady`, an :class:`EpochEnd` or :class:`RunDone`."""
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
        if self.space is not None:
            self.space.close()
        self.disk.close()

    # ------------------------------------------------------------------ creators
    def _load_cache(self) -> None:
        """Load the static cache (first run of the sampler only), before any block is read."""
        if self.cache is not None and self.cache.ensure_loaded(self.disk.payload, self.stop):
            self._verify()
            logger.info("static cache: pinned %d records (%.1f MiB)", self.cache.count,
                        self.cache.count * self.disk.record_nbytes / 2**20)

    def _fill(self, keys: np.ndarray, out: np.ndarray, read: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray | None:
        """Fill a RAM block; ``rows`` maps plan order to buffer rows (``None``: identity)."""
        if self.cache is None:
            read(keys, out)
            return None
        return self.cache.fill(keys, out, read, stats=self._stats.cache)

    def _ssd_creator(self) -> None:
        """Disk -> SSD: reservoir j = the next K1 keys of the plan, written in ascending key order."""
        assert self.space is not None and self.ssd_block is not None
        self._load_cache()
        j = 0
        for seg in self._segments:
            keys = seg.keys
            for a in range(0, keys.size, self.ssd_block):
                res_keys = keys[a : a + self.ssd_block]
                slot = self._get(self._ssd_slots)
                dest: Path | None = None
                if self.cache is not None:
                    res_keys = res_keys[~self.cache.lookup(res_keys)[0]]  # pinned keys stay in RAM
                if res_keys.size:
                    dest = self.space.reservoir_path(j)
                    written = write_reservoir(self.disk, res_keys, dest, self.stop)
                    self._verify()
                    self._stats.add_written(written)
                self._put(self._ssd_q, ReservoirWritten(seg, a, dest, slot))
                j += 1
            self._put(self._ssd_q, EpochEnd(seg))
        self._put(self._ssd_q, RunDone())

    def _ram_from_ssd(self) -> None:
        """SSD -> RAM: RAM blocks of K2 positions inside each reservoir, read in ascending offsets."""
        assert self.space is not None and self.ssd_block is not None
        while True:
            match self._get(self._ssd_q):
                case ReservoirWritten() as res:
                    self._blocks_of_reservoir(res)
                case RunDone() as done:
                    self._put(self._ready, done)
                    return
                case other:
                    self._put(self._ready, other)

    def _blocks_of_reservoir(self, item: ReservoirWritten) -> None:
        """Pass one SSD reservoir on as RAM blocks, then delete it and free its slot."""
        assert self.space is not None and self.ssd_block is not None
        seg, a = item.segment, item.start
        res_keys = seg.keys[a : a + self.ssd_block]
        if self.cache is not None:
            stored = np.unique(res_keys[~self.cache.lookup(res_keys)[0]])
        else:
            stored = np.unique(res_keys)  # the reservoir holds its keys in ascending order
        res = Dataset(item.path, stats=self._stats.ssd, gap_bytes=self._gap) if item.path is not None else None

        def read(keys: np.ndarray, out: np.ndarray) -> None:
            assert res is not None  # only unpinned keys are read, and then the reservoir exists
            res.payload.read(np.searchsorted(stored, keys), out=out)

        try:
            for b in range(0, res_keys.size, self.ram_block):
                block_keys = res_keys[b : b + self.ram_block]
                idx = self._get(self._free)
                rows = self._fill(block_keys, self._buffers[idx], read)
                self._put(self._ready, BlockFilled(seg, a + b, block_keys.size, idx, rows))
        finally:
            if res is not None:
                res.close()
            if item.path is not None:
                self.space.remove(item.path)
        self._ssd_slots.put(item.slot)

    def _ram_from_disk(self) -> None:
        """Disk -> RAM: RAM block b = the next K2 keys of the plan, read in ascending offsets."""
        self._load_cache()

        def read(keys: np.ndarray, out: np.ndarray) -> None:
            self.disk.payload.read(keys, out=out)

        for seg in self._segments:
            keys = seg.keys
            for a in range(0, keys.size, self.ram_block):
                block_keys = keys[a : a + self.ram_block]
                idx = self._get(self._free)
                rows = self._fill(block_keys, self._buffers[idx], read)
                self._verify()
                self._put(self._ready, BlockFilled(seg, a, block_keys.size, idx, rows))
            self._put(self._ready, EpochEnd(seg))
        self._put(self._ready, RunDone())

    def _batch_creator(self) -> None:
        """RAM -> batches: consecutive slices of the plan, in order; a batch may span two blocks."""
        seg: Segment | None = None
        bi = 0
        cur: np.ndarray | None = None
        filled = 0
        while True:
            match self._get(self._ready):
                case RunDone() as done:
                    self._put(self.batches, done)
                    return
                case EpochEnd() as end:
                    self._put(self.batches, end)
                    seg, cur = None, None
                case BlockFilled() as block:
                    if block.segment is not seg:
                        seg, bi, cur, filled = block.segment, 0, None, 0
                    bi, cur, filled = self._batches_from_block(block, bi, cur, filled)
                    self._free.put(block.buffer)

    def _batches_from_block(
        self, block: BlockFilled, bi: int, cur: np.ndarray | None, filled: int
    ) -> tuple[int, np.ndarray | None, int]:
        """Copy one RAM block into batches; returns the state of the batch being built
        (its index in the plan, its buffer, rows filled) for the next block."""
        seg, n, rows = block.segment, block.count, block.rows
        payload = self.disk.payload
        data = self._buffers[block.buffer]
        c = 0
        while c < n:
            size = int(seg.plan.batch_sizes[bi])
            if cur is None:
                cur, filled = payload.empty(size), 0
            take = min(size - filled, n - c)
            cur[filled : filled + take] = data[c : c + take] if rows is None else data[rows[c : c + take]]
            self._stats.ram.add("ram", block.start + c, take * payload.record_nbytes)
            filled += take
            c += take
            if filled == size:
                b0 = int(seg.batch_starts[bi])
                batch = assemble_batch(self._payload_name, cur, self._fields, seg.keys[b0 : b0 + size])
                self._stats.ram.add_records(size)
                self._put(self.batches, BatchReady(batch, seg.epoch, int(seg.plan.positions[bi])))
                bi += 1
                cur = None
        return bi, cur, filled
