"""The sampler's schedule on keys alone: which keys, in which order, for which consumer, in what blocks.

Everything here is pure arithmetic on record keys (no payload, no I/O), so it can be tested
exhaustively and the tier stack only has to deliver the keys it is given, in that order. This module
is the **only** owner of the global-batch arithmetic and of the block-size rules: the tiered
sampler, the shared tier stack, the adapters (``len``, resume) and the benchmarks all call it, so a
change of the rule (node-aware assignment, say) is made here once.

Global-batch semantics
----------------------
An epoch's *global stream* ``pi`` has ``N`` keys:

* ``epoch`` mode: a uniform random permutation of ``range(N)`` drawn from
  ``seeds.rng(Domain.EPOCH_ORDER, seed, epoch)``;
* ``replacement`` mode: ``ceil(N / K)`` independent reservoirs, each a uniform ``K``-subset of
  ``range(N)`` drawn with Algorithm L from ``seeds.rng(Domain.REPLACEMENT, seed, epoch)`` and
  emitted in uniformly random order, truncated to ``N`` keys;
* ``sequential`` mode: ``range(N)``.

Global batch ``g`` is ``pi[p0 + g*B*W : p0 + (g+1)*B*W]`` where ``p0`` is the resume position, ``B``
the per-consumer batch size and ``W`` the number of consumers; consumer ``c`` takes
``pi[p0 + g*B*W + c*B : p0 + g*B*W + (c+1)*B]``. ``pi`` itself does not depend on ``W``, so a run
resumed at position ``p0`` with another world size continues the same order. In a ragged final
global batch the first consumers get records and the last may get fewer or none; ``drop_last``
drops that incomplete global batch so every consumer gets the same number of batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardkit.errors import ConfigError
from shardkit.readers.reservoir import reservoir_keys
from shardkit.readers.seeds import Domain, rng

__all__ = [
    "MODES",
    "BATCH_PREFETCH",
    "epoch_permutation",
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
    "ConsumerPlan",
    "consumer_plan",
    "truncate_plan",
    "GroupRows",
    "step_group_positions",
]

MODES = ("epoch", "replacement", "sequential")
#: Batches the batch creator may have ready ahead of the consumer (part of the RAM budget rule).
BATCH_PREFETCH = 2


# ---------------------------------------------------------------------------------------------- streams
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch order ``pi``: a uniform random permutation of ``range(n)`` defined by ``(seed, epoch)``."""
    return rng(Domain.EPOCH_ORDER, seed, epoch).permutation(int(n)).astype(np.int64, copy=False)


def replacement_stream(seed: int, epoch: int, n: int, k: int) -> np.ndarray:
    """``ceil(n / k)`` independent uniform ``k``-reservoirs of ``range(n)``, concatenated, first ``n`` keys."""
    n, k = int(n), max(1, min(int(k), int(n)))
    if n == 0:
        return np.empty(0, dtype=np.int64)
    gen = rng(Domain.REPLACEMENT, seed, epoch)
    parts = [reservoir_keys(n, k, gen) for _ in range(math.ceil(n / k))]
    return np.concatenate(parts)[:n]


def epoch_stream(mode: str, seed: int, epoch: int, n: int, reservoir: int = 1) -> np.ndarray:
    """The global stream of one epoch in ``mode`` (see module docstring); ``reservoir`` is ``K``."""
    if mode == "epoch":
        return epoch_permutation(seed, epoch, n)
    if mode == "replacement":
        return replacement_stream(seed, epoch, n, reservoir)
    if mode == "sequential":
        return np.arange(int(n), dtype=np.int64)
    raise ConfigError(f"mode: expected one of {', '.join(MODES)}, found {mode!r}")


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


def consumer_plan(
    stream: np.ndarray,
    start: int,
    batch_size: int,
    rank: int,
    world_size: int,
    drop_last: bool = False,
) -> ConsumerPlan:
    """Slice consumer ``rank`` of ``world_size`` out of ``stream[start:]`` (global-batch semantics)."""
    n = int(stream.shape[0])
    b, w, c, start = int(batch_size), int(world_size), int(rank), int(start)
    gb = b * w
    share = epoch_share(n, b, c, w, drop_last=drop_last, start=start)
    full = share.full
    # Full global batches: consumer c's slice is B records at offset c*B inside each.
    idx = start + (np.arange(full, dtype=np.int64) * gb + c * b)[:, None] + np.arange(b, dtype=np.int64)[None, :]
    keys = [stream[idx.reshape(-1)]]
    sizes = [np.full(full, b, dtype=np.int64)]
    positions = [start + (np.arange(full, dtype=np.int64) + 1) * gb]
    if share.tail:
        lo = start + full * gb + c * b
        keys.append(stream[lo : lo + share.tail])
        sizes.append(np.array([share.tail], dtype=np.int64))
        positions.append(np.array([n], dtype=np.int64))
    return ConsumerPlan(
        keys=np.concatenate(keys).astype(np.int64, copy=False),
        batch_sizes=np.concatenate(sizes),
        positions=np.concatenate(positions),
    )


def truncate_plan(plan: ConsumerPlan, left: int, world_size: int) -> ConsumerPlan:
    """Cut a plan after ``left`` keys (the sampler's ``limit``).

    The last batch is cut short. With one consumer its position is exact (the rest of the batch is
    emitted after a resume); with several the position stays at the end of the global batch, since
    the other consumers' slices of it are not accounted for here.
    """
    ends = np.cumsum(plan.batch_sizes)
    nb = int(np.searchsorted(ends, left, side="left")) + 1
    sizes = plan.batch_sizes[:nb].copy()
    positions = plan.positions[:nb].copy()
    cut = int(ends[nb - 1] - left)
    if cut:
        sizes[-1] -= cut
        if world_size == 1:
            positions[-1] -= cut
    return ConsumerPlan(keys=plan.keys[:left], batch_sizes=sizes, positions=positions)


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
    together. Node-aware assignment (:mod:`shardkit.readers.locality`) moves keys only inside a
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
