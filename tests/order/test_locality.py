"""Node partition and node-aware assignment (shardkit.order.locality): pure functions of keys.

Exhaustive over small cases and property-based over larger ones: each member takes exactly its
quota, every row keeps its set of positions, the hits are the most any assignment can get, misses are
balanced inside a node, every consumer computes the same answer alone, and with no pinned key the
assignment is the plain slicing. Statistical tests: alpha = 1e-3, fixed seeds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from shardkit.errors import ConfigError
from shardkit.order.locality import (
    NodeLayout,
    assign_rows,
    balanced_split,
    expected_hit_fraction,
    local_consumer_plan,
    node_partition,
)
from shardkit.order.schedule import ConsumerPlan, consumer_plan, epoch_permutation, step_group_positions
from shardkit.order.seeds import Domain, rng
from tests.helpers.order_stats import ALPHA


# ---------------------------------------------------------------------------------------------- partition
@pytest.mark.parametrize("n,m,c", [(0, 1, 0), (1, 3, 1), (10, 3, 4), (10, 3, 2), (100, 4, 25), (101, 4, 30), (64, 1, 64)])
def test_partition_is_disjoint_sized_and_pure(n: int, m: int, c: int) -> None:
    p = node_partition(7, n, m, c)
    assert p.per_node == min(c, -(-n // m) if n else 0)
    seen: set[int] = set()
    for node in range(m):
        keys = p.pinned_keys(node)
        assert np.all(np.diff(keys) > 0)
        np.testing.assert_array_equal(keys, np.flatnonzero(p.holder == node))
        assert keys.size == min(p.per_node, len(range(node, n, m)))
        assert not seen & set(keys.tolist())
        seen |= set(keys.tolist())
        # Depth parts are disjoint and make up the whole set (RAM part, SSD part).
        cut = p.per_node // 2
        parts = np.concatenate([p.pinned_keys(node, 0, cut), p.pinned_keys(node, cut)])
        np.testing.assert_array_equal(np.sort(parts), keys)
    assert p.pinned_total == len(seen) == min(n, m * p.per_node)
    np.testing.assert_array_equal(node_partition(7, n, m, c).holder, p.holder)  # a pure function


def test_partition_draws_from_its_domain_and_grows_nested() -> None:
    n, m = 50, 3
    sigma = rng(Domain.NODE_PARTITION, 11, m).permutation(n)
    p = node_partition(11, n, m, 17)
    for i, key in enumerate(sigma):
        assert p.holder[key] == i % m
    small = node_partition(11, n, m, 5)
    for node in range(m):
        assert set(small.pinned_keys(node)) <= set(p.pinned_keys(node))
    assert not np.array_equal(node_partition(12, n, m, 17).holder, p.holder)
    assert not np.array_equal(node_partition(11, n, 2, 17).holder >= 0, node_partition(11, n, 5, 17).holder >= 0)


def test_each_node_pins_a_uniform_subset() -> None:
    """Over many seeds, how often node 1 pins each key is uniform: chi-square, N - 1 df, alpha 1e-3."""
    n, m, c, trials = 40, 3, 5, 4000
    counts = np.zeros(n)
    for seed in range(trials):
        counts[node_partition(seed, n, m, c).pinned_keys(1)] += 1
    expected = trials * c / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # Inclusion indicators of a fixed-size subset are negatively correlated: scale by (N-1)/N.
    assert stats.chi2.sf(chi2 * (n - 1) / n, n - 1) > ALPHA


def test_partition_refuses_bad_counts() -> None:
    with pytest.raises(ConfigError, match="nodes: expected at least 1"):
        node_partition(0, 10, 0, 1)
    with pytest.raises(ConfigError, match="node: expected 0 <= node < 2"):
        node_partition(0, 10, 2, 1).pinned_keys(2)


# ---------------------------------------------------------------------------------------------- layout
def test_layout_numbers_consumers_like_torchrun_and_dataloader() -> None:
    lay = NodeLayout(consumers=12, workers_per_rank=3, nodes=2)
    assert (lay.ranks, lay.ranks_per_node) == (4, 2)
    assert [lay.node_of(c) for c in range(12)] == [0] * 6 + [1] * 6
    assert [lay.rank_of(c) for c in range(12)] == [c // 3 for c in range(12)]
    np.testing.assert_array_equal(lay.member_nodes(), [0, 0, 1, 1])
    with pytest.raises(ConfigError, match="workers_per_rank: expected a divisor of world_size=4"):
        NodeLayout(consumers=4, workers_per_rank=3)
    with pytest.raises(ConfigError, match="nodes: expected a divisor of the 4 ranks"):
        NodeLayout(consumers=4, nodes=3)


# ---------------------------------------------------------------------------------------------- assignment
def _check(holders: np.ndarray, quotas: np.ndarray, mnodes: np.ndarray) -> None:
    """Every property of the rule on one input (see the module docstring of locality)."""
    got = assign_rows(holders, quotas, mnodes)
    g, s = holders.shape
    nodes = int(mnodes.max()) + 1
    cap = np.bincount(mnodes, weights=quotas, minlength=nodes)
    assert got.member.shape == got.hit.shape == (g, s)
    for row in range(g):
        member, hit, h = got.member[row], got.hit[row], holders[row]
        # Exactly its quota per member; every position goes to exactly one member.
        np.testing.assert_array_equal(np.bincount(member, minlength=quotas.size), quotas)
        node = mnodes[member]
        # A hit is a key pinned on the taker's node, and every such key counts as a hit.
        np.testing.assert_array_equal(hit, h == node)
        # Maximal: sum over nodes of min(pinned keys in the row, the node's room).
        x = np.bincount(h[h >= 0], minlength=nodes)
        assert int(hit.sum()) == int(np.minimum(x, cap).sum())
        for m in range(nodes):
            mem = np.flatnonzero(mnodes == m)
            if mem.size == 0:
                continue
            at = node == m
            misses = np.array([np.count_nonzero((member == j) & ~hit) for j in mem])
            np.testing.assert_array_equal(misses, balanced_split(int(misses.sum()), quotas[mem]))
            # Contiguous runs: the node's misses (and hits), in position order, go to its members in turn.
            for flag in (True, False):
                seq = member[at & (hit == flag)]
                assert np.all(np.diff(seq) >= 0)
            # The node keeps its first pinned keys in position order.
            kept = np.flatnonzero(at & hit)
            np.testing.assert_array_equal(kept, np.flatnonzero(h == m)[: kept.size])


@pytest.mark.parametrize("nodes,per_node,b", [(1, 1, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 2, 1), (3, 1, 1), (2, 2, 2)])
def test_assignment_exhaustive_small(nodes: int, per_node: int, b: int) -> None:
    """Every holder pattern over {-1, 0, ..., M-1}^S for small rows."""
    mnodes = np.repeat(np.arange(nodes), per_node)
    s = nodes * per_node * b
    quotas = np.full(mnodes.size, b)
    rows = np.array(list(itertools.product(range(-1, nodes), repeat=s)), dtype=np.int64)
    _check(rows, quotas, mnodes)


@settings(max_examples=150, deadline=None)
@given(
    nodes=st.integers(1, 5),
    per_node=st.integers(1, 3),
    b=st.integers(1, 7),
    g=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    fill=st.floats(0.0, 1.0),
)
def test_assignment_properties(nodes: int, per_node: int, b: int, g: int, seed: int, fill: float) -> None:
    gen = np.random.default_rng(seed)
    mnodes = np.repeat(np.arange(nodes), per_node)
    s = mnodes.size * b
    holders = np.where(gen.random((g, s)) < fill, gen.integers(0, nodes, (g, s)), -1)
    _check(holders, np.full(mnodes.size, b), mnodes)


@settings(max_examples=150, deadline=None)
@given(nodes=st.integers(1, 4), per_node=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), b=st.integers(1, 6))
def test_assignment_with_ragged_quotas(nodes: int, per_node: int, seed: int, b: int) -> None:
    """A ragged tail: the first members take B, then one takes a part, the rest nothing."""
    gen = np.random.default_rng(seed)
    mnodes = np.repeat(np.arange(nodes), per_node)
    total = int(gen.integers(1, mnodes.size * b + 1))
    quotas = np.clip(total - np.arange(mnodes.size) * b, 0, b)
    holders = np.where(gen.random((1, total)) < 0.7, gen.integers(0, nodes, (1, total)), -1)
    _check(holders, quotas, mnodes)


def test_uniform_and_general_paths_agree() -> None:
    """The closed-form split for equal quotas is the water-filling loop's answer."""
    from shardkit.order import locality

    gen = np.random.default_rng(5)
    for _ in range(200):
        nodes, per_node, b = (int(x) for x in gen.integers(1, 5, 3))
        mnodes = np.repeat(np.arange(nodes), per_node)
        s = mnodes.size * b
        h = np.where(gen.random((3, s)) < gen.random(), gen.integers(0, nodes, (3, s)), -1)
        cap = np.full(nodes, per_node * b)
        parts = locality._nodes_of_positions(h, cap)
        uniform = locality._members_uniform(*parts, per_node, b)
        general = locality._members_general(*parts, np.full(mnodes.size, b), mnodes)
        np.testing.assert_array_equal(uniform, general)


def test_no_pinned_key_is_the_plain_slicing() -> None:
    for nodes, per_node, b in [(1, 1, 4), (2, 3, 5), (4, 2, 1)]:
        s = nodes * per_node * b
        got = assign_rows(np.full((3, s), -1), np.full(nodes * per_node, b), np.repeat(np.arange(nodes), per_node))
        np.testing.assert_array_equal(got.member, np.tile(np.repeat(np.arange(nodes * per_node), b), (3, 1)))
        assert not got.hit.any()


def test_assignment_refuses_bad_input() -> None:
    with pytest.raises(ConfigError, match="quotas: expected 2 non-negative quotas summing to 4"):
        assign_rows(np.zeros((1, 4), dtype=np.int64), [1, 2], [0, 0])
    with pytest.raises(ConfigError, match="member_nodes: expected non-decreasing"):
        assign_rows(np.zeros((1, 2), dtype=np.int64), [1, 1], [1, 0])
    with pytest.raises(ConfigError, match=r"holders: expected node numbers in \[-1, 1\)"):
        assign_rows(np.full((1, 2), 3), [1, 1], [0, 0])
    with pytest.raises(ConfigError, match="balanced split"):
        balanced_split(5, [1, 2])


# ---------------------------------------------------------------------------------------------- plans
PLAN_GRID = list(
    itertools.product(
        [0, 13, 64, 101],  # n
        [0, 5],  # start
        [1, 4],  # batch size
        [(1, 1, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2), (6, 3, 1), (4, 1, 4)],  # (consumers, workers per rank, nodes)
        [False, True],  # drop_last
        [0, 3, 1000],  # keys pinned per node
    )
)


@pytest.mark.parametrize("n,start,b,layout,drop_last,per_node", PLAN_GRID)
def test_local_plans_keep_every_step_set_and_every_count(
    n: int, start: int, b: int, layout: tuple[int, int, int], drop_last: bool, per_node: int
) -> None:
    w, k, m = layout
    if start > n:
        return
    lay = NodeLayout(w, k, m)
    stream = epoch_permutation(3, 1, n)
    part = node_partition(9, n, m, per_node)
    plans = [local_consumer_plan(stream, start, b, c, lay, part, drop_last) for c in range(w)]
    plain = [consumer_plan(stream, start, b, c, w, drop_last) for c in range(w)]
    for c in range(w):
        got, ref = plans[c].plan, plain[c]
        np.testing.assert_array_equal(got.batch_sizes, ref.batch_sizes)
        np.testing.assert_array_equal(got.positions, ref.positions)
        assert got.keys.size == ref.keys.size
        np.testing.assert_array_equal(plans[c].hit, part.holders(got.keys) == lay.node_of(c))
        if per_node == 0:
            np.testing.assert_array_equal(got.keys, ref.keys)
    # Every step's set of keys: the step group's consumers' batches number j, plain vs local.
    for group in range(k):
        members = [r * k + group for r in range(lay.ranks)]
        for j in range(plain[members[0]].num_batches):
            local = np.concatenate([_batch(plans[c].plan, j) for c in members])
            ref_set = np.concatenate([_batch(plain[c], j) for c in members])
            np.testing.assert_array_equal(np.sort(local), np.sort(ref_set))
    everything = np.concatenate([p.plan.keys for p in plans])
    np.testing.assert_array_equal(np.sort(everything), np.sort(np.concatenate([p.keys for p in plain])))


def _batch(plan: ConsumerPlan, j: int) -> np.ndarray:
    """Keys of batch ``j`` of a plan (empty past its end)."""
    if j >= plan.num_batches:
        return np.empty(0, dtype=np.int64)
    end = int(np.cumsum(plan.batch_sizes)[j])
    return plan.keys[end - int(plan.batch_sizes[j]) : end]


def test_step_groups_tile_the_plain_slices() -> None:
    n, b, w, k = 103, 4, 6, 3
    for start in (0, 7):
        seen = []
        for group in range(k):
            rows = step_group_positions(n, start, b, w, k, group)
            seen += rows.full.ravel().tolist() + rows.tail.tolist()
            for c in range(group, w, k):
                plan = consumer_plan(np.arange(n), start, b, c, w)
                r = c // k
                mine = np.concatenate([rows.full[:, r * b : (r + 1) * b].ravel(),
                                       rows.tail[rows.tail_quotas[:r].sum() : rows.tail_quotas[: r + 1].sum()]])  # fmt: skip
                np.testing.assert_array_equal(plan.keys, mine)
        assert sorted(seen) == list(range(start, n))


def test_local_plan_refuses_a_mismatched_partition() -> None:
    stream = epoch_permutation(0, 0, 20)
    with pytest.raises(ConfigError, match="node partition for 3 nodes used with a layout of 2 nodes"):
        local_consumer_plan(stream, 0, 2, 0, NodeLayout(4, 1, 2), node_partition(0, 20, 3, 5))
    with pytest.raises(ConfigError, match="node partition of 21 records used with a stream of 20"):
        local_consumer_plan(stream, 0, 2, 0, NodeLayout(4, 1, 2), node_partition(0, 21, 2, 5))


# ---------------------------------------------------------------------------------------------- model
def test_full_coverage_model_is_the_mean_absolute_deviation_formula() -> None:
    """1 - E|X - RB| / (2RB), X ~ Hypergeometric(N, N/M, MRB), for a node count dividing N."""
    for n, m, r, b in [(4096, 4, 2, 32), (6000, 3, 1, 100), (1024, 2, 4, 8)]:
        x = np.arange(0, m * r * b + 1)
        pmf = stats.hypergeom(n, n // m, m * r * b).pmf(x)
        want = 1 - float(np.abs(x - r * b) @ pmf) / (2 * r * b)
        assert expected_hit_fraction(n, m, r, b, n // m) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("m,r,b,per_node", [(4, 2, 16, 1024), (4, 2, 16, 512), (3, 1, 40, 700), (8, 1, 8, 512)])
def test_model_matches_the_measured_hit_rate(m: int, r: int, b: int, per_node: int) -> None:
    """Mean hit fraction of the real assignment over many global batches vs the model: |z| < 3.3."""
    n = 4096
    lay = NodeLayout(m * r, 1, m)
    part = node_partition(4, n, m, per_node)
    fractions = []
    for epoch in range(12):
        stream = epoch_permutation(21, epoch, n)
        rows = step_group_positions(n, 0, b, lay.consumers, 1, 0, drop_last=True)
        got = assign_rows(part.holders(stream[rows.full]), np.full(lay.ranks, b), lay.member_nodes())
        fractions += got.hit.mean(axis=1).tolist()
    f = np.asarray(fractions)
    z = (f.mean() - expected_hit_fraction(n, m, r, b, per_node)) / (f.std(ddof=1) / np.sqrt(f.size))
    assert abs(z) < stats.norm.isf(ALPHA / 2)
