"""Many nodes: which node caches which keys, and which consumer takes which keys of a global batch.

docs/design.md §10 as pure functions of keys (no I/O, no communication): every rank computes the
same answers, and only which member of a step group takes which key changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shardkit.errors import ConfigError
from shardkit.order.schedule import ConsumerPlan, EpochOrder, PlanShape, consumer_plan, step_group_positions
from shardkit.order.seeds import Domain, rng

__all__ = [
    "NodeLayout",
    "NodePartition",
    "node_partition",
    "Assignment",
    "assign_rows",
    "balanced_split",
    "LocalPlan",
    "local_positions",
    "local_consumer_plan",
    "LocalShape",
    "local_shape",
    "expected_hit_fraction",
]


@dataclass(frozen=True)
class NodeLayout:
    """Where the consumers of a run sit: consumer ``c`` is worker ``c % workers_per_rank`` of rank
    ``c // workers_per_rank`` (the PyTorch adapter's numbering), rank ``r`` on node ``r //
    ranks_per_node`` (torchrun's). A step group is the consumers with one worker index."""

    consumers: int
    workers_per_rank: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        c, k, m = int(self.consumers), int(self.workers_per_rank), int(self.nodes)
        if c < 1 or k < 1 or m < 1:
            raise ConfigError(f"node layout: expected positive counts, found consumers={c}, workers_per_rank={k}, nodes={m}")
        if c % k:
            raise ConfigError(f"workers_per_rank: expected a divisor of world_size={c}, found {k}")
        if (c // k) % m:
            raise ConfigError(f"nodes: expected a divisor of the {c // k} ranks (world_size / workers_per_rank), found {m}")

    @property
    def ranks(self) -> int:
        """Ranks (training processes): the members of every step group."""
        return self.consumers // self.workers_per_rank

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes

    def rank_of(self, consumer: int) -> int:
        return int(consumer) // self.workers_per_rank

    def node_of(self, consumer: int) -> int:
        """The node consumer ``consumer`` runs on."""
        return self.rank_of(consumer) // self.ranks_per_node

    def member_nodes(self) -> np.ndarray:
        """Node of each member (rank) of a step group, in member order."""
        return np.arange(self.ranks, dtype=np.int64) // self.ranks_per_node


@dataclass(frozen=True, eq=False)
class NodePartition:
    """Which node of ``nodes`` pins which of ``num_records`` keys (docs/design.md §10, partition);
    build it with :func:`node_partition`."""

    seed: int
    num_records: int
    nodes: int
    #: ``c``: keys each node pins (at most ``ceil(N / M)``).
    per_node: int
    #: ``[N]`` small ints: the node that pins each key, ``-1`` for none (the only per-key state).
    holder: np.ndarray

    @property
    def pinned_total(self) -> int:
        return int(np.count_nonzero(self.holder >= 0))

    @property
    def coverage(self) -> float:
        """``f``: the fraction of the dataset some node pins."""
        return self.pinned_total / self.num_records if self.num_records else 0.0

    def holders(self, keys: np.ndarray) -> np.ndarray:
        """The node that pins each of ``keys`` (int64, ``-1`` for none)."""
        return self.holder[np.asarray(keys, dtype=np.int64)].astype(np.int64)

    def pinned_keys(self, node: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The keys node ``node`` pins at depths ``[lo, hi)`` of its home list (default: all),
        ascending; a split by depth gives disjoint uniformly random parts (RAM, local disk)."""
        node = int(node)
        if not 0 <= node < self.nodes:
            raise ConfigError(f"node: expected 0 <= node < {self.nodes}, found {node}")
        hi = self.per_node if hi is None else min(int(hi), self.per_node)
        home = _sigma(self.seed, self.num_records, self.nodes)[node :: self.nodes]
        return np.sort(home[max(0, int(lo)) : hi]).astype(np.int64, copy=False)


def _sigma(seed: int, n: int, nodes: int) -> np.ndarray:
    return rng(Domain.NODE_PARTITION, seed, nodes).permutation(int(n)).astype(np.int64, copy=False)


def node_partition(seed: int, num_records: int, nodes: int, per_node: int) -> NodePartition:
    """The partition of ``range(num_records)`` among ``nodes`` nodes pinning ``per_node`` keys each
    (capped at ``ceil(num_records / nodes)``: a key is pinned by at most one node)."""
    n, m = int(num_records), int(nodes)
    if m < 1:
        raise ConfigError(f"nodes: expected at least 1, found {nodes}")
    if n < 0 or int(per_node) < 0:
        raise ConfigError(f"node partition: expected non-negative counts, found num_records={n}, per_node={per_node}")
    c = min(int(per_node), -(-n // m)) if n else 0
    dtype = np.int8 if m < 2**7 else np.int16 if m < 2**15 else np.int32
    holder = np.full(n, -1, dtype=dtype)
    if c:
        sigma = _sigma(seed, n, m)
        pinned = min(n, m * c)
        holder[sigma[:pinned]] = (np.arange(pinned, dtype=np.int64) % m).astype(dtype)
    return NodePartition(seed=int(seed), num_records=n, nodes=m, per_node=c, holder=holder)


# ---------------------------------------------------------------------------------------------- assignment
@dataclass(frozen=True, eq=False)
class Assignment:
    """Which member takes each position of each row, and whether it is a hit."""

    #: ``[G, S]`` int64: the member (rank index in the step group) that takes each position.
    member: np.ndarray
    #: ``[G, S]`` bool: the position's key is pinned on the node of the member that takes it.
    hit: np.ndarray

    def positions_of(self, member: int) -> np.ndarray:
        """``[G, S]`` bool: the positions ``member`` takes (its quota in every row)."""
        return np.asarray(self.member == int(member))


def balanced_split(total: int, caps: Sequence[int] | np.ndarray) -> np.ndarray:
    """``total`` items split over members with room ``caps``: as even as the caps allow, the
    remainder one each to the first members that have room (water filling)."""
    caps = np.asarray(caps, dtype=np.int64)
    total = int(total)
    if total < 0 or total > int(caps.sum()):
        raise ConfigError(f"balanced split: expected 0 <= total <= {int(caps.sum())}, found {total}")
    if caps.size == 0:
        return caps.copy()
    lo, hi = 0, int(caps.max())
    while lo < hi:  # the largest level L with sum(min(caps, L)) <= total
        mid = (lo + hi + 1) // 2
        if int(np.minimum(caps, mid).sum()) <= total:
            lo = mid
        else:
            hi = mid - 1
    split = np.minimum(caps, lo)
    rest = total - int(split.sum())
    room = np.flatnonzero(caps > lo)[:rest]
    split[room] += 1
    return np.asarray(split, dtype=np.int64)


def assign_rows(holders: np.ndarray, quotas: Sequence[int] | np.ndarray, member_nodes: Sequence[int] | np.ndarray) -> Assignment:
    """Assign the positions of every row (a step group's positions in one global batch) to members.

    Parameters
    ----------
    holders
        ``[G, S]`` int: the node that pins each position's key (``-1``: none).
    quotas
        ``[P]``: positions each member takes in every row; they sum to ``S``.
    member_nodes
        ``[P]``: each member's node, non-decreasing (the members of a node are consecutive).

    The rule: docs/design.md §10 (*Assignment*); the same inputs give the same answer on every rank.
    """
    h = np.asarray(holders, dtype=np.int64)
    if h.ndim != 2:
        raise ConfigError(f"holders: expected a [rows, positions] array, found shape {h.shape}")
    q = np.asarray(quotas, dtype=np.int64)
    mn = np.asarray(member_nodes, dtype=np.int64)
    g, s = h.shape
    if q.shape != mn.shape or int(q.sum()) != s or (q < 0).any():
        raise ConfigError(f"quotas: expected {mn.size} non-negative quotas summing to {s}, found {q.tolist()}")
    if mn.size and ((np.diff(mn) < 0).any() or mn[0] < 0):
        raise ConfigError(f"member_nodes: expected non-decreasing node numbers, found {mn.tolist()}")
    nodes = int(mn.max()) + 1 if mn.size else 0
    if h.size and (h.max() >= nodes or h.min() < -1):
        raise ConfigError(f"holders: expected node numbers in [-1, {nodes}), found [{int(h.min())}, {int(h.max())}]")
    if g == 0 or s == 0:
        return Assignment(np.zeros((g, s), dtype=np.int64), np.zeros((g, s), dtype=bool))
    cap = np.bincount(mn, weights=q, minlength=nodes).astype(np.int64)
    node, hit, miss_index, hit_index, deficit = _nodes_of_positions(h, cap)
    counts = np.bincount(mn, minlength=nodes)
    per_node = int(counts[0])
    if (counts == per_node).all() and (q == q[0]).all():
        member = _members_uniform(node, hit, miss_index, hit_index, deficit, per_node, int(q[0]))
    else:
        member = _members_general(node, hit, miss_index, hit_index, deficit, q, mn)
    return Assignment(member, hit)


def _nodes_of_positions(
    h: np.ndarray, cap: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps 1-3 of the rule, vectorised over rows: each position's node and hit flag, its index
    among its node's misses (or hits) of the row, and each ``(row, node)``'s misses."""
    g, s = h.shape
    m = cap.size
    row = np.repeat(np.arange(g, dtype=np.int64), s)
    flat = h.ravel()
    # Rank of each position among the positions of its row with the same holder, in position
    # order: a stable sort by (row, holder) keeps position order inside each group.
    group = row * (m + 1) + (flat + 1)
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    rank = np.empty(g * s, dtype=np.int64)
    rank[order] = np.arange(g * s, dtype=np.int64) - np.searchsorted(sorted_group, sorted_group, side="left")
    pinned = flat >= 0
    hit = pinned & (rank < cap[np.where(pinned, flat, 0)])
    kept = np.bincount((row * m + flat)[hit], minlength=g * m).reshape(g, m)
    deficit = cap[None, :] - kept
    free = ~hit
    free_rank = np.cumsum(free.reshape(g, s), axis=1).ravel() - 1
    bounds = np.cumsum(deficit, axis=1)
    # Row-major offsets make the rows' boundaries one increasing sequence for one searchsorted.
    flat_bounds = (bounds + (np.arange(g, dtype=np.int64) * s)[:, None]).ravel()
    fr, frow = free_rank[free], row[free]
    free_node = np.searchsorted(flat_bounds, fr + frow * s, side="right") - frow * m
    node = flat.copy()
    node[free] = free_node
    miss_index = np.zeros(g * s, dtype=np.int64)
    starts = bounds - deficit
    miss_index[free] = fr - starts[frow, free_node]
    hit_index = np.where(hit, rank, 0)
    return (node.reshape(g, s), hit.reshape(g, s), miss_index.reshape(g, s), hit_index.reshape(g, s), deficit)


def _members_uniform(
    node: np.ndarray, hit: np.ndarray, miss_index: np.ndarray, hit_index: np.ndarray, deficit: np.ndarray, r: int, b: int
) -> np.ndarray:
    """Step 4 when every node has ``r`` members of quota ``b``: closed-form balanced split."""
    g = node.shape[0]
    d = deficit[np.arange(g)[:, None], node]
    base, extra = d // r, d % r
    big = base + 1
    j_miss = np.where(miss_index < extra * big, miss_index // big, extra + (miss_index - extra * big) // np.maximum(base, 1))
    s1, s2 = b - base - 1, b - base
    j_hit = np.where(hit_index < extra * s1, hit_index // np.maximum(s1, 1), extra + (hit_index - extra * s1) // np.maximum(s2, 1))
    return np.asarray(node * r + np.where(hit, j_hit, j_miss), dtype=np.int64)


def _members_general(
    node: np.ndarray, hit: np.ndarray, miss_index: np.ndarray, hit_index: np.ndarray, deficit: np.ndarray,
    quotas: np.ndarray, member_nodes: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Step 4 for any quotas (the ragged tail): a loop over rows and nodes with :func:`balanced_split`."""
    g = node.shape[0]
    member = np.empty(node.shape, dtype=np.int64)
    first = np.searchsorted(member_nodes, np.arange(deficit.shape[1]), side="left")
    for row in range(g):
        for m in range(deficit.shape[1]):
            lo = int(first[m])
            caps = quotas[lo : lo + int(np.count_nonzero(member_nodes == m))]
            if caps.size == 0:
                continue
            misses = balanced_split(int(deficit[row, m]), caps)
            miss_ends = np.cumsum(misses)
            hit_ends = np.cumsum(caps - misses)
            at = node[row] == m
            idx = np.where(hit[row, at], hit_index[row, at], miss_index[row, at])
            ends = np.where(hit[row, at][:, None], hit_ends[None, :], miss_ends[None, :])
            member[row, at] = lo + (idx[:, None] >= ends).sum(axis=1)
    return member


# ---------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True, eq=False)
class LocalPlan:
    """A consumer's node-aware plan: the plain plan's batch sizes and positions, its own keys."""

    #: Keys in emission order (each batch's in epoch order), batch sizes and positions as
    #: :func:`~shardkit.order.schedule.consumer_plan` has them.
    plan: ConsumerPlan
    #: Per key of ``plan.keys``: pinned on this consumer's node.
    hit: np.ndarray


def local_positions(
    keys_at: Callable[[np.ndarray], np.ndarray],
    n: int,
    start: int,
    batch_size: int,
    rank: int,
    layout: NodeLayout,
    partition: NodePartition,
    drop_last: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The epoch positions consumer ``rank`` takes from ``[start, n)`` under the node-aware
    assignment, in its emission order (each batch in epoch order), and whether each one's key is
    pinned on its node; ``keys_at(positions)`` gives the epoch order's keys."""
    if partition.nodes != layout.nodes:
        raise ConfigError(f"node partition for {partition.nodes} nodes used with a layout of {layout.nodes} nodes")
    if int(n) != partition.num_records:
        raise ConfigError(f"node partition of {partition.num_records} records used with a stream of {n}")
    b, k = int(batch_size), layout.workers_per_rank
    rows = step_group_positions(n, start, b, layout.consumers, k, int(rank) % k, drop_last=drop_last)
    member = layout.rank_of(rank)
    nodes_of = layout.member_nodes()
    groups = []  # (rows of epoch positions, each member's quota in every row)
    if rows.full.size:
        groups.append((rows.full, np.full(layout.ranks, b)))
    if rows.tail_quotas[member]:
        groups.append((rows.tail[None, :], rows.tail_quotas))
    positions, hits = [], []
    for table, quotas in groups:
        keys = np.asarray(keys_at(table.reshape(-1)), dtype=np.int64).reshape(table.shape)
        got = assign_rows(partition.holders(keys), quotas, nodes_of)
        mine = got.positions_of(member)
        positions.append(table[mine])  # row-major: global batch by global batch, epoch order inside
        hits.append(got.hit[mine])
    if not positions:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    return np.concatenate(positions).astype(np.int64, copy=False), np.concatenate(hits)


def local_consumer_plan(
    stream: np.ndarray,
    start: int,
    batch_size: int,
    rank: int,
    layout: NodeLayout,
    partition: NodePartition,
    drop_last: bool = False,
) -> LocalPlan:
    """Consumer ``rank``'s keys of ``stream[start:]`` under the node-aware assignment
    (:func:`local_positions` over an epoch order held as an array)."""
    n = int(stream.shape[0])
    plain = consumer_plan(stream, start, batch_size, rank, layout.consumers, drop_last)
    positions, hit = local_positions(stream.__getitem__, n, start, batch_size, rank, layout, partition, drop_last)
    if positions.size != plain.keys.size:  # pragma: no cover - quotas are the plain plan's by construction
        raise ConfigError(f"node-aware plan of consumer {rank}: {positions.size} keys, expected {plain.keys.size}")
    return LocalPlan(plan=dataclasses.replace(plain, keys=stream[positions].astype(np.int64, copy=False)), hit=hit)


@dataclass(frozen=True, eq=False)
class LocalShape(PlanShape):
    """A :class:`~shardkit.order.schedule.PlanShape` whose epoch positions (``table``, in plan
    order, computed once per epoch by :func:`local_shape`) come from the node-aware assignment."""

    table: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)

    def epoch_positions(self, a: int, b: int) -> np.ndarray:
        return np.asarray(self.table[int(a) : int(b)], dtype=np.int64)

    def truncated(self, left: int) -> LocalShape:
        cut = super().truncated(left)
        return LocalShape(cut.start, cut.batch_size, cut.rank, cut.world_size, cut.length, cut.batch_sizes,
                          cut.positions, table=self.table[: int(left)])  # fmt: skip


def local_shape(
    shape: PlanShape, order: EpochOrder, layout: NodeLayout, partition: NodePartition, drop_last: bool = False
) -> LocalShape:
    """``shape`` (a consumer's plain plan of one epoch) with the node-aware split of ``order``'s
    global batches among the consumers of each step (:func:`local_positions`)."""
    table, _ = local_positions(order.keys, order.size, shape.start, shape.batch_size, shape.rank, layout, partition,
                               drop_last)  # fmt: skip
    if table.size != shape.length:  # pragma: no cover - quotas are the plain plan's by construction
        raise ConfigError(f"node-aware plan of consumer {shape.rank}: {table.size} positions, expected {shape.length}")
    return LocalShape(shape.start, shape.batch_size, shape.rank, shape.world_size, shape.length, shape.batch_sizes,
                      shape.positions, table=table)  # fmt: skip


# ---------------------------------------------------------------------------------------------- model
def expected_hit_fraction(num_records: int, nodes: int, ranks_per_node: int, batch_size: int, per_node: int) -> float:
    """The expected fraction of a full global batch's keys that are hits under :func:`assign_rows`:
    ``sum_m E[min(X_m, R B)] / S``, ``X_m`` hypergeometric (docs/design.md §10, *Expected hits*)."""
    from scipy import stats

    n, m, r, b = int(num_records), int(nodes), int(ranks_per_node), int(batch_size)
    s = m * r * b
    if n == 0 or s == 0 or s > n:
        raise ConfigError(f"expected_hit_fraction: expected 0 < nodes*ranks_per_node*batch_size = {s} <= num_records = {n}")
    c = min(int(per_node), -(-n // m))
    total = 0.0
    x = np.arange(0, min(s, c) + 1)
    for node in range(m):
        home = len(range(node, n, m))
        pinned = min(c, home)
        pmf = stats.hypergeom(n, pinned, s).pmf(x[: min(s, pinned) + 1])
        total += float(np.minimum(x[: pmf.size], r * b) @ pmf)
    return total / s if not math.isnan(total) else 0.0
