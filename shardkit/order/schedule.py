"""The sampler's schedule on keys alone: which keys, in which order, for which consumer, in what blocks.

Everything here is pure arithmetic on record keys (no payload, no I/O), so it can be tested
exhaustively and the tier stack only delivers the keys it is given, in that order. This module is
the only owner of the global-batch arithmetic and the block-size rules: the sampler, ``serve``, the
adapters (``len``, resume) and the benchmarks all call it, so a rule changes here once. Semantics
of global batches, blocks and resume: docs/design.md §4 (*The schedule*).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from shardkit.errors import ConfigError
from shardkit.order.bijection import FeistelPermutation
from shardkit.order.reservoir import reservoir_keys
from shardkit.order.seeds import Domain, rng

__all__ = [
    "MODES",
    "BATCH_PREFETCH",
    "epoch_permutation",
    "permute_into",
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
    "pool_batches",
    "FIRST_BLOCK_BYTES",
    "MIN_BLOCK_BYTES",
    "BLOCK_EFFICIENCY",
    "QUEUE_OVERLAP",
    "PERMUTATIONS",
    "EXACT_PERMUTATION_LIMIT",
    "resolve_permutation",
    "EpochOrder",
    "ArrayOrder",
    "BijectionOrder",
    "RangeOrder",
    "epoch_order",
    "PlanShape",
    "plan_shape",
    "ConsumerPlan",
    "consumer_plan",
    "truncate_plan",
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


# ---------------------------------------------------------------------------------------------- streams
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch order ``pi``: a uniform random permutation of ``range(n)`` defined by ``(seed, epoch)``."""
    return permute_into(seed, epoch, np.empty(int(n), dtype=np.int64))


def permute_into(seed: int, epoch: int, out: np.ndarray) -> np.ndarray:
    """:func:`epoch_permutation` written into ``out`` (int64, e.g. node-shared memory), no other copy.

    Identical to ``Generator.permutation(n)``, which is ``arange(n)`` shuffled in place.
    """
    out[:] = np.arange(out.shape[0], dtype=np.int64)
    rng(Domain.EPOCH_ORDER, seed, epoch).shuffle(out)
    return out


def replacement_stream(seed: int, epoch: int, n: int, k: int) -> np.ndarray:
    """``ceil(n / k)`` independent uniform ``k``-reservoirs of ``range(n)``, concatenated, first ``n`` keys."""
    n, k = int(n), max(1, min(int(k), int(n)))
    if n == 0:
        return np.empty(0, dtype=np.int64)
    gen = rng(Domain.REPLACEMENT, seed, epoch)
    parts = [reservoir_keys(n, k, gen) for _ in range(math.ceil(n / k))]
    return np.concatenate(parts)[:n]


def epoch_stream(mode: str, seed: int, epoch: int, n: int, reservoir: int = 1) -> np.ndarray:
    """The global stream of one epoch in ``mode``; ``reservoir`` is ``K``.

    ``epoch``: a uniform permutation of ``range(n)`` from ``Domain.EPOCH_ORDER`` with ``(seed,
    epoch)``. ``replacement``: ``ceil(n / K)`` independent reservoirs, each a uniform ``K``-subset
    drawn with Algorithm L from ``Domain.REPLACEMENT`` and emitted in uniform order, truncated to
    ``n`` keys. ``sequential``: ``range(n)``.
    """
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
    """One epoch's global stream ``pi`` as a function: the key at any set of positions.

    The pipeline asks for the keys of one block at a time, so an order that computes them on
    demand (:class:`BijectionOrder`) holds nothing per record, and one that is an array
    (:class:`ArrayOrder`) may live in memory shared by every process of a node.
    """

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
    """The global stream of one epoch (as :func:`epoch_stream`) in the form the pipeline reads it.

    ``epoch`` mode with the ``feistel`` permutation is a :class:`BijectionOrder`, which is *not*
    :func:`epoch_permutation` (a different, statistically uniform order; see
    :mod:`shardkit.order.bijection`); every other combination is exactly :func:`epoch_stream`.
    """
    if mode == "epoch" and resolve_permutation(permutation, n) == "feistel":
        return BijectionOrder(FeistelPermutation.for_epoch(seed, epoch, max(1, int(n))))
    if mode == "sequential":
        return RangeOrder(int(n))
    return ArrayOrder(epoch_stream(mode, seed, epoch, n, reservoir))


# ---------------------------------------------------------------------------------------------- counts
@dataclass(frozen=True)
class EpochShare:
    """What one consumer gets from one epoch, counted from a start position.

    Attributes
    ----------
    full
        Whole global batches left in the epoch: the consumer gets ``B`` records from each.
    tail
        The consumer's records in the ragged final global batch (0 when there is none, when
        ``drop_last`` drops it, or when the consumer's slice of it is empty).
    batch_size
        ``B``.
    """

    full: int
    tail: int
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
    """An upper bound of any consumer's records in one epoch, ``ceil(N / (B*W)) * B``.

    Block sizes are capped by it (a block larger than what a consumer ever reads would only waste
    RAM); it depends on neither the rank nor the resume position, so every consumer of a run, and a
    resumed run, derives the same ``K`` (which replacement mode's stream depends on).
    """
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
    """``K2``, records per RAM block, from a consumer's whole RAM budget.

    The budget covers two blocks (double buffering) and, when it is at least twice their size, the
    batches in flight (``BATCH_PREFETCH + 2`` batches: prefetched, being built, held by the
    consumer). At least one record; at most ``records_bound`` (see :func:`consumer_records_bound`).
    """
    rec = int(record_nbytes)
    reserve = (BATCH_PREFETCH + 2) * int(batch_size) * rec
    blocks = ram_bytes - reserve if ram_bytes >= 2 * reserve else ram_bytes
    return max(1, min(blocks // (2 * rec), max(1, int(records_bound))))


def ssd_block(ssd_bytes: int, record_nbytes: int, records_bound: int) -> int:
    """``K1``, records per SSD reservoir: two reservoirs fill the budget; at least one record, at
    most ``records_bound``."""
    return max(1, min(int(ssd_bytes) // (2 * int(record_nbytes)), max(1, int(records_bound))))


#: The run's first RAM block holds about this many bytes (at least one batch): read in a few tens
#: of milliseconds, so the first batch arrives quickly whatever the budget. Later blocks double
#: until they reach the largest block (:func:`block_bounds`).
FIRST_BLOCK_BYTES = 16 << 20
#: Blocks are at least this large when the budget allows: each block costs a few Python passes
#: and one announcement per run, and a block of a few hundred large records keeps a device queue
#: of that depth busy.
MIN_BLOCK_BYTES = 64 << 20
#: The read efficiency (see :func:`read_efficiency`) a block's density should reach, if the budget
#: allows; blocks no larger than needed leave the rest of the budget to the static cache.
BLOCK_EFFICIENCY = 0.9
#: A request announced ahead (the reader announces every run of a block before reading it) costs
#: ``gap_bytes / QUEUE_OVERLAP`` of sequential transfer: the device overlaps it with the ones queued
#: behind it. Calibrated on the measured density curve (``benchmarks/RESULTS.md``, "Calibration of
#: the block read model").
QUEUE_OVERLAP = 4


def read_efficiency(density: float, record_nbytes: int, gap_bytes: int) -> float:
    """Fraction of sequential speed at which a block of ``density`` (records in the block / records
    in the dataset) is read, in a cost model of the bottom tier.

    The wanted records of a shard are a uniform random subset, so between two of them lie ``j``
    unwanted records with ``P(j) = d (1 - d)**j``. A gap of ``j * record_nbytes <= gap_bytes`` is
    read (coalesced) and costs its bytes; a larger gap is skipped at the price of one more request,
    ``gap_bytes / QUEUE_OVERLAP`` bytes of transfer time. The efficiency is
    ``record_nbytes / (record_nbytes + E[gap bytes read] + P(new request) * request cost)``: near 1
    for large records at any density, and close to the density itself for records much smaller
    than ``gap_bytes`` (reading everything to use a fraction) until blocks are nearly the whole
    dataset.
    """
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


def block_limits(
    budget_records: int,
    record_nbytes: int,
    batch_size: int,
    num_records: int,
    gap_bytes: int,
    records_bound: int,
    aligned: bool = True,
) -> tuple[int, int]:
    """``(first, largest)`` RAM block of a run, in records.

    ``largest`` is what the density rule asks for (:func:`density_block`, and at least
    :data:`MIN_BLOCK_BYTES`), never more than ``budget_records`` (what the budget allows per block)
    or ``records_bound``; ``first`` is about :data:`FIRST_BLOCK_BYTES` and at most ``largest``.
    ``aligned``: both are whole batches when they hold at least one, so no batch spans two blocks
    and a block needs exactly ``largest / B`` batch buffers.
    """
    rec, b = int(record_nbytes), int(batch_size)
    want = max(density_block(num_records, rec, gap_bytes), -(-MIN_BLOCK_BYTES // rec))
    largest = max(1, min(want, int(budget_records), max(1, int(records_bound))))
    first = min(largest, max(b, -(-FIRST_BLOCK_BYTES // rec)))

    def whole(k: int) -> int:
        return k - k % b if aligned and k >= b else k

    return whole(first), whole(largest)


def block_bounds(start: int, stop: int, first: int, largest: int) -> Iterator[tuple[int, int]]:
    """Consecutive blocks ``[a, b)`` covering plan positions ``[start, stop)``: ``first`` records,
    then twice as many each time up to ``largest``.

    Any partition of ``pi`` into consecutive blocks keeps the order exactly as it is (docs/design.md §4),
    so this is free to serve speed: a small first block gets the first batch out quickly, larger
    ones read near sequential speed.
    """
    size, a = max(1, int(first)), int(start)
    largest = max(size, int(largest))
    while a < stop:
        b = min(int(stop), a + size)
        yield a, b
        a, size = b, min(largest, 2 * size)


def pool_batches(block: int, batch_size: int, aligned: bool = True) -> int:
    """Batch buffers a run needs: two blocks in flight (one being read, one being emitted) and the
    batches the consumer holds (:data:`~shardkit.tiers.buffers.HOLD_BATCHES`). A block of ``K``
    records covers ``ceil(K / B)`` batches, one more when blocks are not ``aligned`` to batches
    (a batch then spans two blocks)."""
    from shardkit.tiers.buffers import HOLD_BATCHES

    per_block = -(-int(block) // int(batch_size)) + (0 if aligned else 1)
    return 2 * per_block + HOLD_BATCHES


# ---------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's share of one epoch from a start position.

    Attributes
    ----------
    keys
        The consumer's keys ``sigma_c`` in emission order (its slices of the global batches).
    batch_sizes
        Length of each of its batches (all ``B`` except possibly the last).
    positions
        Global position (records of ``pi`` consumed) after each of its batches.
    """

    keys: np.ndarray
    batch_sizes: np.ndarray
    positions: np.ndarray

    @property
    def num_batches(self) -> int:
        return int(self.batch_sizes.shape[0])


@dataclass(frozen=True, eq=False)
class PlanShape:
    """One consumer's share of one epoch as arithmetic: which positions of ``pi``, in which batches.

    The keys are not materialised: plan position ``p`` (the consumer's ``p``-th record) is epoch
    position :meth:`epoch_positions` of ``p``, so the pipeline asks the epoch's order for the keys
    of one block at a time.

    Attributes
    ----------
    start, batch_size, rank, world_size
        The resume position, ``B``, ``c`` and ``W``.
    length
        Records in the plan.
    batch_sizes
        Length of each batch (all ``B`` except possibly the last).
    positions
        Global position after each batch.
    """

    start: int
    batch_size: int
    rank: int
    world_size: int
    length: int
    batch_sizes: np.ndarray = field(repr=False)
    positions: np.ndarray = field(repr=False)

    @property
    def num_batches(self) -> int:
        return int(self.batch_sizes.shape[0])

    def epoch_positions(self, a: int, b: int) -> np.ndarray:
        """Epoch positions of plan positions ``[a, b)``: batch ``g = p // B`` of the consumer is its
        slice ``[c*B, (c+1)*B)`` of global batch ``g`` (the tail batch included)."""
        p = np.arange(int(a), int(b), dtype=np.int64)
        bs, gb = self.batch_size, self.batch_size * self.world_size
        return self.start + (p // bs) * gb + self.rank * bs + p % bs

    def truncated(self, left: int) -> PlanShape:
        """The plan cut after ``left`` records (see :func:`truncate_plan`)."""
        sizes, positions = _cut_batches(self.batch_sizes, self.positions, left, self.world_size)
        return PlanShape(self.start, self.batch_size, self.rank, self.world_size, int(left), sizes, positions)


def plan_shape(n: int, start: int, batch_size: int, rank: int, world_size: int, drop_last: bool = False) -> PlanShape:
    """Consumer ``rank`` of ``world_size``'s share of positions ``[start, n)`` (global-batch semantics)."""
    b, w, c, start = int(batch_size), int(world_size), int(rank), int(start)
    share = epoch_share(n, b, c, w, drop_last=drop_last, start=start)
    full = share.full
    sizes = [np.full(full, b, dtype=np.int64)]
    positions = [start + (np.arange(full, dtype=np.int64) + 1) * b * w]
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


def truncate_plan(plan: ConsumerPlan, left: int, world_size: int) -> ConsumerPlan:
    """Cut a plan after ``left`` keys (the sampler's ``limit``).

    The last batch is cut short. With one consumer its position is exact (the rest of the batch is
    emitted after a resume); with several the position stays at the end of the global batch, since
    the other consumers' slices of it are not accounted for here.
    """
    sizes, positions = _cut_batches(plan.batch_sizes, plan.positions, left, world_size)
    return ConsumerPlan(keys=plan.keys[:left], batch_sizes=sizes, positions=positions)


def _cut_batches(
    batch_sizes: np.ndarray, positions: np.ndarray, left: int, world_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Batch sizes and positions of a plan cut after ``left`` records (see :func:`truncate_plan`)."""
    ends = np.cumsum(batch_sizes)
    nb = int(np.searchsorted(ends, left, side="left")) + 1
    sizes, positions = batch_sizes[:nb].copy(), positions[:nb].copy()
    cut = int(ends[nb - 1] - left)
    if cut:
        sizes[-1] -= cut
        if world_size == 1:
            positions[-1] -= cut
    return sizes, positions


# ---------------------------------------------------------------------------------------------- step groups
@dataclass(frozen=True, eq=False)
class GroupRows:
    """The epoch positions one step group takes from each global batch (see :func:`step_group_positions`).

    Attributes
    ----------
    full
        ``[G, ranks * B]``: row ``g`` holds the group's positions in full global batch ``g``;
        member ``r`` (rank ``r``) takes columns ``[r*B, (r+1)*B)`` in the plain slicing.
    tail
        The group's positions in the ragged final global batch (members' slices one after
        another; empty when there is none or ``drop_last`` drops it).
    tail_quotas
        ``[ranks]``: how many of ``tail`` each member takes.
    """

    full: np.ndarray
    tail: np.ndarray
    tail_quotas: np.ndarray


def step_group_positions(
    n: int, start: int, batch_size: int, world_size: int, workers_per_rank: int, group: int, *, drop_last: bool = False
) -> GroupRows:
    """Epoch positions of step group ``group`` in every global batch of ``[start, n)``.

    With ``k = workers_per_rank`` consumers per rank, consumer ``c`` is worker ``c % k`` of rank
    ``c // k``, and a rank's DataLoader hands out its workers' batches in turn, so the training step
    that uses batch ``g`` of worker ``w`` gets, from every rank ``r``, consumer ``r*k + w``'s slice of
    global batch ``g``. Those consumers are step group ``w``: the positions a step trains on
    together. Node-aware assignment (:mod:`shardkit.order.locality`) moves keys only inside a
    group's row, so every step keeps the set of positions of ``pi`` it has here.
    """
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
