"""The sampler's schedule on keys alone: which keys, in which order, for which consumer, in what blocks.

Pure arithmetic on record keys, the one owner of the global-batch arithmetic and the block-size
rules (docs/design.md §4, *The schedule*).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from shardkit.errors import ConfigError
from shardkit.formats.arrays import distinct_sorted
from shardkit.order.bijection import FeistelPermutation
from shardkit.order.reservoir import reservoir_keys
from shardkit.order.seeds import Domain, rng
from shardkit.stopping import POLL_SECONDS, Stopped

__all__ = [
    "MODES",
    "BATCH_PREFETCH",
    "epoch_permutation",
    "permute_into",
    "HEAD_THRESHOLD",
    "HEAD_RECORDS",
    "head_size",
    "head_keys",
    "replacement_stream",
    "epoch_stream",
    "EpochShare",
    "epoch_share",
    "batches_per_consumer",
    "records_per_consumer",
    "consumer_records_bound",
    "consumer_slice",
    "pass_length",
    "position_after",
    "ram_block",
    "ssd_block",
    "read_efficiency",
    "density_block",
    "block_limits",
    "block_bounds",
    "span_block",
    "pool_batches",
    "FIRST_BLOCK_BYTES",
    "FIRST_BLOCK_RECORDS",
    "BLOCK_RECORD_BYTES",
    "STAGED_RECORD_BYTES",
    "DUPLICATE_RECORD_BYTES",
    "MIN_BLOCK_BYTES",
    "BLOCK_EFFICIENCY",
    "QUEUE_OVERLAP",
    "PERMUTATIONS",
    "EXACT_PERMUTATION_LIMIT",
    "resolve_permutation",
    "EpochOrder",
    "ArrayOrder",
    "HeadFirstOrder",
    "BijectionOrder",
    "RangeOrder",
    "epoch_order",
    "PlanShape",
    "plan_shape",
    "ConsumerPlan",
    "consumer_plan",
    "GroupRows",
    "step_group_positions",
]

MODES = ("epoch", "replacement", "sequential")
#: Batches the batch creator may have ready ahead of the consumer (part of the RAM budget rule).
BATCH_PREFETCH = 2
#: How the epoch order of ``epoch`` mode is drawn: ``exact`` (numpy's permutation, 8 bytes a
#: record), ``feistel`` (an on-demand bijection, nothing per record), ``auto`` (exact up to
#: :data:`EXACT_PERMUTATION_LIMIT` records, feistel beyond).
PERMUTATIONS = ("auto", "exact", "feistel")
#: ``auto`` uses the exact permutation up to this many records (800 MB of int64 per node).
EXACT_PERMUTATION_LIMIT = 10**8


#: Above this many records the exact permutation draws its first :data:`HEAD_RECORDS` positions
#: on their own, before the rest: the first block's keys are known in O(head), not after an O(N)
#: shuffle (a numpy shuffle of 10^8 int64 takes over 10 s). At or below it the order is numpy's
#: ``Generator.permutation(n)`` itself.
HEAD_THRESHOLD = 1 << 22
#: The head: the first block (:data:`FIRST_BLOCK_RECORDS`) of each of 32 consumers sharing the order,
#: drawn in tens of milliseconds (more consumers wait for the whole order before their first batch).
HEAD_RECORDS = 1 << 18
#: Records of the complement written per step (bounded temporaries while the rest is drawn).
_COMPLEMENT_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------- streams
def head_size(n: int, head: int | None = None) -> int:
    """Positions of the exact permutation of ``n`` records drawn before the rest (0: none);
    ``head`` overrides the default rule (a head of all ``n`` positions means none)."""
    n = int(n)
    k = (HEAD_RECORDS if n > HEAD_THRESHOLD else 0) if head is None else max(0, int(head))
    return k if k < n else 0


def epoch_permutation(seed: int, epoch: int, n: int, head: int | None = None) -> np.ndarray:
    """The epoch order ``pi``: a uniform random permutation of ``range(n)`` defined by ``(seed, epoch)``
    (``head`` overrides :func:`head_size`, see :func:`permute_into`)."""
    return permute_into(seed, epoch, np.empty(int(n), dtype=np.int64), head)


def permute_into(seed: int, epoch: int, out: np.ndarray, head: int | None = None) -> np.ndarray:
    """:func:`epoch_permutation` written into ``out`` (int64, e.g. node-shared memory), no other copy
    of ``N`` records.

    Without a head (``n <= HEAD_THRESHOLD``) it is ``Generator.permutation(n)``. With a head of
    ``k`` positions, ``pi[:k]`` is a uniform ordered ``k``-sample without replacement
    (:func:`head_keys`) and ``pi[k:]`` a uniform permutation of the other keys, drawn from the same
    generator afterwards: the product of the two laws is the uniform law on permutations, so the order
    is exactly uniform, and its head is known before the rest is drawn."""
    n = int(out.shape[0])
    k = head_size(n, head)
    gen = rng(Domain.EPOCH_ORDER, seed, epoch)
    if k == 0:
        out[:] = np.arange(n, dtype=np.int64)
        gen.shuffle(out)
        return out
    first = _distinct_draws(gen, n, k)
    out[:k] = first
    _complement_into(np.sort(first), out[k:])
    gen.shuffle(out[k:])
    return out


def head_keys(seed: int, epoch: int, n: int, head: int | None = None) -> np.ndarray:
    """``pi[:k]`` of :func:`epoch_permutation` in O(k) (``k`` = :func:`head_size` or ``head``)."""
    k = head_size(n, head)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    return _distinct_draws(rng(Domain.EPOCH_ORDER, seed, epoch), n, k)


def _distinct_draws(gen: np.random.Generator, n: int, k: int) -> np.ndarray:
    """The first ``k`` distinct values of an i.i.d. uniform stream over ``range(n)``, in the order
    they first appear: each is uniform over the values not seen yet, so this is a uniform ordered
    sample without replacement. The stream is drawn in pieces (about the expected length) and
    de-duplicated by sorting: O(k log k), nothing of size ``n``."""
    got = np.empty(0, dtype=np.int64)
    while got.size < k:
        need = k - got.size
        draw = gen.integers(0, n, size=need + need * k // max(1, n - k) + 64, dtype=np.int64)
        stream = np.concatenate([got, draw])  # ``got`` is distinct and comes first: it keeps its place
        got = _first_occurrences(stream)[:k]
    return got


def _first_occurrences(stream: np.ndarray) -> np.ndarray:
    """``stream`` without the repeats of a value after its first occurrence (order kept). Repeats are
    rare here, so a plain sort finds the repeated values and only their occurrences are ranked."""
    ordered = np.sort(stream)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if not repeated.size:
        return stream
    values = distinct_sorted(repeated)  # not np.unique: its first call imports numpy.ma
    at = np.searchsorted(values, stream).clip(max=values.size - 1)
    where = np.flatnonzero(values[at] == stream)  # every occurrence of a repeated value, ascending
    _, first = np.unique(stream[where], return_index=True)  # stable: the first occurrence of each
    keep = np.ones(stream.size, dtype=bool)
    keep[where] = False
    keep[where[first]] = True
    return stream[keep]


def _complement_into(taken: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the values of ``range(len(taken) + len(out))`` not in ``taken`` (sorted, distinct),
    ascending, in chunks: value ``i`` of the complement is ``i + #{j : taken[j] - j <= i}``."""
    m = int(out.shape[0])
    shifted = taken - np.arange(taken.size, dtype=np.int64)  # non-decreasing
    for a in range(0, m, _COMPLEMENT_CHUNK):
        b = min(m, a + _COMPLEMENT_CHUNK)
        lo, hi = np.searchsorted(shifted, [a, b], side="left")
        steps = np.bincount(shifted[lo:hi] - a, minlength=b - a)
        np.cumsum(steps, out=steps)
        out[a:b] = np.arange(a + lo, b + lo, dtype=np.int64) + steps


def replacement_stream(seed: int, epoch: int, n: int, k: int) -> np.ndarray:
    """``ceil(n / k)`` independent uniform ``k``-reservoirs of ``range(n)``, concatenated, first ``n`` keys."""
    n, k = int(n), max(1, min(int(k), int(n)))
    if n == 0:
        return np.empty(0, dtype=np.int64)
    gen = rng(Domain.REPLACEMENT, seed, epoch)
    parts = [reservoir_keys(n, k, gen) for _ in range(math.ceil(n / k))]
    return np.concatenate(parts)[:n]


def epoch_stream(mode: str, seed: int, epoch: int, n: int, reservoir: int = 1) -> np.ndarray:
    """The global stream of one epoch in ``mode`` (docs/design.md §4, *Modes*); ``reservoir`` is ``K``."""
    if mode == "epoch":
        return epoch_permutation(seed, epoch, n)
    if mode == "replacement":
        return replacement_stream(seed, epoch, n, reservoir)
    if mode == "sequential":
        return np.arange(int(n), dtype=np.int64)
    raise ConfigError(f"mode: expected one of {', '.join(MODES)}, found {mode!r}")


def resolve_permutation(permutation: str, n: int) -> str:
    """``"exact"`` or ``"feistel"``: the epoch order ``permutation`` (see :data:`PERMUTATIONS`) means
    for a dataset of ``n`` records."""
    if permutation not in PERMUTATIONS:
        raise ConfigError(f"permutation: expected one of {', '.join(PERMUTATIONS)}, found {permutation!r}")
    if permutation == "auto":
        return "exact" if int(n) <= EXACT_PERMUTATION_LIMIT else "feistel"
    return permutation


@runtime_checkable
class EpochOrder(Protocol):
    """One epoch's global stream ``pi`` as a function: the key at any set of positions (asked one
    block at a time, so an order may be computed on demand or live in node-shared memory)."""

    @property
    def size(self) -> int:
        """``N``: positions (and keys) in the epoch."""
        ...

    def keys(self, positions: np.ndarray) -> np.ndarray:
        """``pi[positions]`` as int64."""
        ...


@dataclass(frozen=True, eq=False)
class ArrayOrder:
    """``pi`` held as an int64 array (private, or a read-only view of node-shared memory)."""

    array: np.ndarray

    @property
    def size(self) -> int:
        return int(self.array.shape[0])

    def keys(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(self.array[positions], dtype=np.int64)


class HeadFirstOrder:
    """An exact order whose head (:func:`head_keys`) answers at once while ``compute`` draws the whole
    order in a background thread: keys of head positions come from the head, any other position
    waits for the whole order. ``compute`` returns that order and what releases it (or ``None``).

    The draw is one numpy shuffle and cannot be interrupted, so nothing waits for it unasked:
    :meth:`cancel` (the run stops) makes a wait for a key beyond the head raise
    :class:`~shardkit.stopping.Stopped` within :data:`~shardkit.stopping.POLL_SECONDS`,
    and :meth:`release` during the draw leaves the release to the drawing thread once it ends."""

    def __init__(self, head: np.ndarray, n: int,
                 compute: Callable[[], tuple[EpochOrder, Callable[[], None] | None]]) -> None:  # fmt: skip
        self._head = head
        self._n = int(n)
        self._compute = compute
        self._order: EpochOrder | None = None
        self._release: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        #: Release the whole order as soon as it is drawn (nobody will ask for its keys).
        self._let_go = False
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardkit-order", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            order, release = self._compute()
        except BaseException as exc:  # re-raised in the thread that asks for a key beyond the head
            self._error = exc
            return
        with self._lock:  # decided under the lock with release(): exactly one of the two releases
            self._order, self._release = order, release
            let_go = self._let_go
        if let_go:
            self._release_once()

    @property
    def size(self) -> int:
        return self._n

    @property
    def drawn(self) -> bool:
        """The whole order is there (or its computation failed)."""
        return not self._thread.is_alive()

    def whole(self) -> EpochOrder:
        """The whole order (waits for the background draw; :class:`Stopped` once cancelled)."""
        while self._thread.is_alive():
            if self._cancelled.is_set():
                raise Stopped()
            self._thread.join(POLL_SECONDS)
        if self._error is not None:
            raise self._error
        assert self._order is not None
        return self._order

    def keys(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        k = self._head.shape[0]
        if not positions.size:
            return np.empty(0, dtype=np.int64)
        if 0 <= int(positions.min()) and int(positions.max()) < k:
            return np.asarray(self._head[positions], dtype=np.int64)
        return self.whole().keys(positions)

    def release(self) -> None:
        """Every key was computed: let go of the whole order's memory now, or, while it is still
        being drawn, as soon as the draw ends (in the drawing thread)."""
        with self._lock:
            self._let_go = True
            drawn = self._order is not None
        if drawn:
            self._release_once()

    def cancel(self) -> None:
        """The run stops: waits for the whole order raise :class:`Stopped`, and the order is
        released once drawn (returns at once)."""
        self._cancelled.set()
        self.release()

    def _release_once(self) -> None:
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


@dataclass(frozen=True, eq=False)
class BijectionOrder:
    """``pi`` computed on demand by a keyed Feistel bijection (:mod:`shardkit.order.bijection`)."""

    permutation: FeistelPermutation

    @property
    def size(self) -> int:
        return self.permutation.n

    def keys(self, positions: np.ndarray) -> np.ndarray:
        return self.permutation(positions)


@dataclass(frozen=True)
class RangeOrder:
    """``pi = range(n)``: storage order (``sequential`` mode)."""

    n: int

    @property
    def size(self) -> int:
        return int(self.n)

    def keys(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64).copy()


def epoch_order(
    mode: str, seed: int, epoch: int, n: int, reservoir: int = 1, permutation: str = "auto"
) -> EpochOrder:
    """The global stream of one epoch in the form the pipeline reads it: exactly :func:`epoch_stream`,
    except ``epoch`` mode with the ``feistel`` permutation (a :class:`BijectionOrder`)."""
    if mode == "epoch" and resolve_permutation(permutation, n) == "feistel":
        return BijectionOrder(FeistelPermutation.for_epoch(seed, epoch, max(1, int(n))))
    if mode == "sequential":
        return RangeOrder(int(n))
    return ArrayOrder(epoch_stream(mode, seed, epoch, n, reservoir))


# ---------------------------------------------------------------------------------------------- counts
@dataclass(frozen=True)
class EpochShare:
    """What one consumer gets from one epoch, counted from a start position."""

    #: Whole global batches left in the epoch: the consumer gets ``B`` records from each.
    full: int
    #: The consumer's records in the ragged final global batch (0: none, dropped, or an empty slice).
    tail: int
    #: ``B``.
    batch_size: int

    @property
    def batches(self) -> int:
        return self.full + (1 if self.tail else 0)

    @property
    def records(self) -> int:
        return self.full * self.batch_size + self.tail


def epoch_share(
    n: int, batch_size: int, rank: int, world_size: int, *, drop_last: bool = False, start: int = 0
) -> EpochShare:
    """Consumer ``rank`` of ``world_size``'s share of the epoch's positions ``[start, n)``."""
    b, w = int(batch_size), int(world_size)
    full, ragged = divmod(max(0, int(n) - int(start)), b * w)
    tail = 0 if drop_last else min(b, max(0, ragged - int(rank) * b))
    return EpochShare(full=full, tail=tail, batch_size=b)


def batches_per_consumer(
    n: int, batch_size: int, rank: int, world_size: int, *, drop_last: bool = False, start: int = 0
) -> int:
    """Batches consumer ``rank`` gets from position ``start`` to the end of the epoch."""
    return epoch_share(n, batch_size, rank, world_size, drop_last=drop_last, start=start).batches


def records_per_consumer(
    n: int, batch_size: int, rank: int, world_size: int, *, drop_last: bool = False, start: int = 0
) -> int:
    """Records consumer ``rank`` gets from position ``start`` to the end of the epoch."""
    return epoch_share(n, batch_size, rank, world_size, drop_last=drop_last, start=start).records


def consumer_records_bound(n: int, batch_size: int, world_size: int) -> int:
    """An upper bound of any consumer's records in one epoch, ``ceil(N / (B*W)) * B``: the cap of block
    sizes, the same for every rank and resume position (replacement mode's stream depends on ``K``)."""
    b = int(batch_size)
    return math.ceil(int(n) / (b * int(world_size))) * b if n else 0


def consumer_slice(
    g: int, n: int, batch_size: int, rank: int, world_size: int, *, drop_last: bool = False, start: int = 0
) -> tuple[int, int] | None:
    """Epoch positions ``[lo, hi)`` of consumer ``rank``'s slice of global batch ``g`` counted from
    ``start``, or ``None`` when the consumer gets nothing from it (past the end, dropped tail)."""
    n, b, w = int(n), int(batch_size), int(world_size)
    first = int(start) + int(g) * b * w
    if drop_last and first + b * w > n:
        return None
    lo = first + int(rank) * b
    if lo >= n:
        return None
    return lo, min(lo + b, n)


def pass_length(
    n: int,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    drop_last: bool,
    start: int,
    epochs: int,
    limit: int | None,
) -> tuple[int, int]:
    """``(batches, records)`` one consumer yields in a pass of ``epochs`` epochs that begins at
    global position ``start`` of its first epoch, cut after ``limit`` records as the sampler does."""
    b = int(batch_size)
    batches = records = 0
    for e in range(int(epochs)):
        share = epoch_share(n, b, rank, world_size, drop_last=drop_last, start=start if e == 0 else 0)
        if limit is not None and records + share.records >= limit:
            left = limit - records
            used = -(-left // b) if left <= share.full * b else share.batches
            return batches + used, int(limit)
        batches += share.batches
        records += share.records
    return batches, records


def position_after(start: int, global_batches: int, batch_size: int, world_size: int, n: int) -> int:
    """The epoch position after ``global_batches`` whole global batches from ``start`` (at most ``n``)."""
    return min(int(n), int(start) + int(global_batches) * int(batch_size) * int(world_size))


# ---------------------------------------------------------------------------------------------- blocks
def ram_block(ram_bytes: int, record_nbytes: int, batch_size: int, records_bound: int) -> int:
    """``K2``, records per RAM block: two blocks fill the budget, less the ``BATCH_PREFETCH + 2``
    batches in flight when it is at least twice that; at least one record, at most ``records_bound``."""
    rec = int(record_nbytes)
    reserve = (BATCH_PREFETCH + 2) * int(batch_size) * rec
    blocks = ram_bytes - reserve if ram_bytes >= 2 * reserve else ram_bytes
    return max(1, min(blocks // (2 * rec), max(1, int(records_bound))))


def ssd_block(ssd_bytes: int, record_nbytes: int, records_bound: int) -> int:
    """``K1``, records per SSD reservoir: two reservoirs fill the budget; at least one record, at
    most ``records_bound``."""
    return max(1, min(int(ssd_bytes) // (2 * int(record_nbytes)), max(1, int(records_bound))))


#: The run's first RAM block holds about this many bytes (at least one batch), so the first batch
#: arrives quickly whatever the budget.
FIRST_BLOCK_BYTES = 16 << 20
#: ... and at most this many records: small records cost more per record than per byte (the first
#: block of 32-byte records would otherwise be half a million records, sorted and planned before the
#: first batch; a first block is sparse, so each of its small records is a request vector entry of
#: its own: 8,192 of them cost tens of milliseconds).
FIRST_BLOCK_RECORDS = 1 << 13
#: Bookkeeping bytes of a block record besides the record, counted in the RAM budget: its key (8,
#: kept until its batch is assembled), its buffer and row (int32 each) and the read's sort (key and
#: position, 16) while it is read; two blocks in flight, one of them being read (docs/design.md §4,
#: *Memory per record*).
BLOCK_RECORD_BYTES = 24
#: The same for a staged block (docs/design.md §4, *Staged blocks*) of keys below 2**31: its key as
#: int32 (4), the sort's packed keys (8, one block at a time), the sort's order and duplicate flags
#: (5, kept with the block until its batches are taken) and the assembler's ranks (4, one block at a
#: time): 15 averaged over the two blocks. ``replacement`` mode's duplicates add the distinct keys'
#: copy (8, one block at a time), counted as :data:`DUPLICATE_RECORD_BYTES` more.
STAGED_RECORD_BYTES = 16
DUPLICATE_RECORD_BYTES = 4
#: Blocks are at least this large when the budget allows (per-block overhead; device queue depth).
MIN_BLOCK_BYTES = 64 << 20
#: The read efficiency a block's density should reach, if the budget allows (the rest of the budget
#: goes to the static cache).
BLOCK_EFFICIENCY = 0.9
#: An announced request costs ``gap_bytes / QUEUE_OVERLAP`` of sequential transfer (calibrated:
#: ``benchmarks/RESULTS.md``, "Calibration of the block read model").
QUEUE_OVERLAP = 4


def read_efficiency(density: float, record_nbytes: int, gap_bytes: int) -> float:
    """Fraction of sequential speed at which a block of ``density`` (records in the block / records
    in the dataset) is read, in the cost model of docs/design.md §4 (*The schedule*, Blocks)."""
    rec = float(record_nbytes)
    d = min(1.0, max(0.0, float(density)))
    if d >= 1.0:
        return 1.0
    q = 1.0 - d
    cap = int(gap_bytes) // int(record_nbytes)  # J: the longest gap (in records) that is read
    if d == 0.0:
        read, skip = 0.0, 1.0
    else:
        # sum_{j<=J} j d q^j, in closed form
        read = rec * q * (1.0 - (cap + 1) * q**cap + cap * q ** (cap + 1)) / d
        skip = q ** (cap + 1)
    return rec / (rec + read + skip * int(gap_bytes) / QUEUE_OVERLAP)


def density_block(num_records: int, record_nbytes: int, gap_bytes: int, target: float = BLOCK_EFFICIENCY) -> int:
    """The smallest block (records) whose density reaches ``target`` in :func:`read_efficiency`
    (``num_records`` when none does below the whole dataset)."""
    n = max(1, int(num_records))
    grid = {max(1, round(n * 2.0 ** (-i / 8))) for i in range(240)} | {max(1, n * j // 100) for j in range(1, 101)}
    for k in sorted(grid):
        if read_efficiency(k / n, record_nbytes, gap_bytes) >= target:
            return int(k)
    return n


def span_block(num_records: int, record_nbytes: int, gap_bytes: int) -> int:
    """The smallest block (records) whose ascending read covers about the whole dataset: its mean
    gap is at most half of ``gap_bytes``, so in the read model (:func:`read_efficiency`) under
    e^-2 of its gaps are skipped. Every block from this size on reads about the dataset's bytes
    (small records reach it within a few batches), so growing through larger ones only repeats
    that read: :func:`block_bounds` goes to the largest block next."""
    per_gap = max(1, int(gap_bytes) // (2 * int(record_nbytes)))  # records in half of the longest gap read
    return max(1, -(-int(num_records) // per_gap))


def block_limits(
    budget_records: int,
    record_nbytes: int,
    batch_size: int,
    num_records: int,
    gap_bytes: int,
    records_bound: int,
    aligned: bool = True,
    sharers: int = 1,
) -> tuple[int, int]:
    """``(first, largest)`` RAM block of a run, in records: ``largest`` as the density rule asks (at
    least :data:`MIN_BLOCK_BYTES`) within ``budget_records`` and ``records_bound``, ``first`` about
    :data:`FIRST_BLOCK_BYTES` but at most :data:`FIRST_BLOCK_RECORDS` (and at least a batch); with
    ``aligned`` both are whole batches when they hold one.

    ``sharers`` consumers (a rank's DataLoader workers) read their first blocks at the same time
    over the same link or disk, and the rank's first batch is the first worker's: each first block
    is then about ``FIRST_BLOCK_BYTES / sharers``, so the rank's first reads stay about
    :data:`FIRST_BLOCK_BYTES` whatever the worker count (docs/design.md §4, *The schedule*)."""
    rec, b = int(record_nbytes), int(batch_size)
    want = max(density_block(num_records, rec, gap_bytes), -(-MIN_BLOCK_BYTES // rec))
    largest = max(1, min(want, int(budget_records), max(1, int(records_bound))))
    first_bytes = FIRST_BLOCK_BYTES // max(1, int(sharers))
    first = min(largest, max(b, min(-(-first_bytes // rec), FIRST_BLOCK_RECORDS)))

    def whole(k: int) -> int:
        return k - k % b if aligned and k >= b else k

    return whole(first), whole(largest)


def block_bounds(start: int, stop: int, first: int, largest: int, span: int | None = None) -> Iterator[tuple[int, int]]:
    """Consecutive blocks ``[a, b)`` covering plan positions ``[start, stop)``: ``first`` records,
    then twice as many each time up to ``largest``; after a block of at least ``span`` records
    (:func:`span_block`: its read already covers about every byte of the dataset, so a larger one
    reads no more bytes) the next is the largest. Any such partition keeps the order."""
    size, a = max(1, int(first)), int(start)
    largest = max(size, int(largest))
    while a < stop:
        b = min(int(stop), a + size)
        yield a, b
        a, size = b, largest if span is not None and b - a >= span else min(largest, 2 * size)


def pool_batches(block: int, batch_size: int, aligned: bool = True) -> int:
    """Batch buffers a run needs: two blocks in flight of ``ceil(K / B)`` batches each (one more when
    not ``aligned``) and the batches the consumer holds (``HOLD_BATCHES``)."""
    from shardkit.tiers.buffers import HOLD_BATCHES

    per_block = -(-int(block) // int(batch_size)) + (0 if aligned else 1)
    return 2 * per_block + HOLD_BATCHES


# ---------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's share of one epoch from a start position."""

    #: The consumer's keys ``sigma_c`` in emission order (its slices of the global batches).
    keys: np.ndarray
    #: Length of each of its batches (all ``B`` except possibly the last).
    batch_sizes: np.ndarray
    #: Global position (records of ``pi`` consumed) after each of its batches.
    positions: np.ndarray

    @property
    def num_batches(self) -> int:
        return int(self.batch_sizes.shape[0])


@dataclass(frozen=True, eq=False)
class PlanShape:
    """One consumer's share of one epoch as arithmetic: plan position ``p`` (the consumer's ``p``-th
    record) is epoch position :meth:`epoch_positions` of ``p``; keys are not materialised. ``start``,
    ``batch_size``, ``rank`` and ``world_size`` are the resume position, ``B``, ``c`` and ``W``."""

    start: int
    batch_size: int
    rank: int
    world_size: int
    #: Records in the plan.
    length: int
    #: Length of each batch (all ``B`` except possibly the last).
    batch_sizes: np.ndarray = field(repr=False)
    #: Global position after each batch.
    positions: np.ndarray = field(repr=False)

    @property
    def num_batches(self) -> int:
        return int(self.batch_sizes.shape[0])

    def epoch_positions(self, a: int, b: int) -> np.ndarray:
        """Epoch positions of plan positions ``[a, b)``: batch ``g = p // B`` of the consumer is its
        slice ``[c*B, (c+1)*B)`` of global batch ``g`` (the tail batch included)."""
        if self.world_size == 1:  # one consumer: its plan is the epoch's positions from start on
            return np.arange(self.start + int(a), self.start + int(b), dtype=np.int64)
        p = np.arange(int(a), int(b), dtype=np.int64)
        bs, gb = self.batch_size, self.batch_size * self.world_size
        return self.start + (p // bs) * gb + self.rank * bs + p % bs

    def truncated(self, left: int) -> PlanShape:
        """The plan cut after ``left`` records (the sampler's ``limit``): the last batch is cut short;
        its position is exact with one consumer, else the end of its global batch."""
        ends = np.cumsum(self.batch_sizes)
        nb = int(np.searchsorted(ends, left, side="left")) + 1
        sizes, positions = self.batch_sizes[:nb].copy(), self.positions[:nb].copy()
        cut = int(ends[nb - 1] - left)
        if cut:
            sizes[-1] -= cut
            if self.world_size == 1:
                positions[-1] -= cut
        return PlanShape(self.start, self.batch_size, self.rank, self.world_size, int(left), sizes, positions)


def plan_shape(n: int, start: int, batch_size: int, rank: int, world_size: int, drop_last: bool = False) -> PlanShape:
    """Consumer ``rank`` of ``world_size``'s share of positions ``[start, n)`` (global-batch semantics)."""
    b, w, c, start = int(batch_size), int(world_size), int(rank), int(start)
    share = epoch_share(n, b, c, w, drop_last=drop_last, start=start)
    sizes = [np.full(share.full, b, dtype=np.int64)]
    positions = [start + (np.arange(share.full, dtype=np.int64) + 1) * b * w]
    if share.tail:
        sizes.append(np.array([share.tail], dtype=np.int64))
        positions.append(np.array([int(n)], dtype=np.int64))
    return PlanShape(start, b, c, w, share.records, np.concatenate(sizes), np.concatenate(positions))


def consumer_plan(
    stream: np.ndarray,
    start: int,
    batch_size: int,
    rank: int,
    world_size: int,
    drop_last: bool = False,
) -> ConsumerPlan:
    """Slice consumer ``rank`` of ``world_size`` out of ``stream[start:]`` (global-batch semantics)."""
    shape = plan_shape(int(stream.shape[0]), start, batch_size, rank, world_size, drop_last)
    return ConsumerPlan(
        keys=np.asarray(stream[shape.epoch_positions(0, shape.length)], dtype=np.int64),
        batch_sizes=shape.batch_sizes,
        positions=shape.positions,
    )


# ---------------------------------------------------------------------------------------------- step groups
@dataclass(frozen=True, eq=False)
class GroupRows:
    """The epoch positions one step group takes from each global batch (see :func:`step_group_positions`)."""

    #: ``[G, ranks * B]``: the group's positions in each full global batch (member ``r`` takes
    #: columns ``[r*B, (r+1)*B)`` in the plain slicing).
    full: np.ndarray
    #: The group's positions in the ragged final global batch (members' slices one after another).
    tail: np.ndarray
    #: ``[ranks]``: how many of ``tail`` each member takes.
    tail_quotas: np.ndarray


def step_group_positions(
    n: int, start: int, batch_size: int, world_size: int, workers_per_rank: int, group: int, *, drop_last: bool = False
) -> GroupRows:
    """Epoch positions of step group ``group`` in every global batch of ``[start, n)``: the slices of
    consumers ``r*k + group`` of every rank ``r`` (``k = workers_per_rank``), which one training
    step uses together (docs/design.md §10, *Assignment*)."""
    b, w, k, grp = int(batch_size), int(world_size), int(workers_per_rank), int(group)
    if k < 1 or w % k or not 0 <= grp < k:
        raise ConfigError(f"workers_per_rank: expected a divisor of world_size={w} above group {grp}, found {k}")
    consumers = np.arange(w // k, dtype=np.int64) * k + grp
    full = epoch_share(n, b, 0, w, drop_last=drop_last, start=start).full
    cols = (consumers[:, None] * b + np.arange(b, dtype=np.int64)[None, :]).reshape(-1)
    rows = int(start) + np.arange(full, dtype=np.int64)[:, None] * (b * w) + cols[None, :]
    quotas = np.array(
        [epoch_share(n, b, int(c), w, drop_last=drop_last, start=start).tail for c in consumers], dtype=np.int64
    )
    lo = int(start) + full * b * w
    tail = np.concatenate([lo + int(c) * b + np.arange(q, dtype=np.int64) for c, q in zip(consumers, quotas)])
    return GroupRows(full=rows, tail=tail.astype(np.int64, copy=False), tail_quotas=quotas)
