"""The mixed order on keys alone (shardkit.order.mixture): exact counts, walks, uniform interleaving.

Statistical tests use alpha = 1e-3 (tests.helpers.order_stats.ALPHA) and fixed seeds. Exact-law tests enumerate
every admissible outcome of a tiny mixture and compare its frequencies over many seeds with chi-square.
They were checked once against broken variants (see each test's docstring).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from scipy import stats

from shardkit.errors import ConfigError
from shardkit.order.mixture import (
    HEAD,
    MixturePlan,
    Walks,
    epoch_counts,
    parse_weights,
    walk_bounds,
)
from shardkit.order.schedule import epoch_order, epoch_permutation
from shardkit.order.seeds import Domain, rng
from shardkit.ordertest import stats as ots
from tests.helpers.order_stats import ALPHA, item_position_pvalue


# ---------------------------------------------------------------------------------------------- counts
@pytest.mark.parametrize(
    "weights,length,expected",
    [
        ([3, 1], 8, (6, 2)),  # divides L
        ([3, 1], 10, (8, 2)),  # 7.5, 2.5: tie, the lower index wins
        ([1, 1], 3, (2, 1)),  # tie
        ([1, 1, 1], 10, (4, 3, 3)),
        ([0.1, 0.2, 0.7], 10, (1, 2, 7)),  # decimal spelling: no binary round-off
        (["1/3", "1/3", "1/3"], 2, (1, 1, 0)),
        ([1, 2, 3, 4], 7, (1, 1, 2, 3)),  # 0.7, 1.4, 2.1, 2.8: remainders .7 .4 .1 .8
        ([5, 1], 1, (1, 0)),
        ([1, 1000], 5, (0, 5)),
    ],
)
def test_counts_are_the_largest_remainder_rounding(weights: list[object], length: int, expected: tuple[int, ...]) -> None:
    assert epoch_counts(weights, length) == expected
    assert sum(expected) == length


@settings(max_examples=300, deadline=None)
@given(
    hs.lists(hs.fractions(min_value=Fraction(1, 1000), max_value=1000), min_size=1, max_size=7),
    hs.integers(min_value=1, max_value=10**7),
)
def test_counts_property(weights: list[Fraction], length: int) -> None:
    """Sum exactly L; each count the floor of its quota or one more; the +1s go to the largest
    fractional parts, ties to the lower index."""
    counts = epoch_counts(weights, length)
    total = sum(weights)
    quotas = [w * length / total for w in weights]
    assert sum(counts) == length
    up = [c - math.floor(q) for c, q in zip(counts, quotas)]
    assert set(up) <= {0, 1}
    rem = [q - math.floor(q) for q in quotas]
    for i, j in itertools.permutations(range(len(weights)), 2):
        if up[i] and not up[j]:
            assert rem[i] > rem[j] or (rem[i] == rem[j] and i < j)


@pytest.mark.parametrize("bad", [[0, 1], [-1, 2], [float("nan")], [float("inf"), 1], ["x"], [True], [None], []])
def test_bad_weights_are_refused(bad: list[object]) -> None:
    with pytest.raises(ConfigError, match="weight"):
        parse_weights(bad)


def test_plan_validation() -> None:
    with pytest.raises(ConfigError, match="one weight per dataset"):
        MixturePlan.create([3, 4], [1])
    with pytest.raises(ConfigError, match="epoch_size"):
        MixturePlan.create([3, 4], [1, 1], epoch_size=0)
    with pytest.raises(ConfigError, match="dataset 1 size"):
        MixturePlan.create([3, 0], [1, 1])
    with pytest.raises(ConfigError, match="epoch_size: an epoch's order holds 8 bytes"):
        MixturePlan.create([3, 4], [1, 1], epoch_size=2**41)
    with pytest.raises(ConfigError, match="seed"):
        MixturePlan.create([3, 4], [1, 1], seed=-1)
    assert MixturePlan.create([3, 4], [1, 1]).epoch_size == 7  # default: the sum of the sizes
    assert MixturePlan.create([3, 4], [1, 1], epoch_size="1k").epoch_size == 1000


@pytest.mark.parametrize(
    "sizes,weights,length", [([7, 5], [3, 1], None), ([7, 5], [3, 1], 10), ([4, 9, 2], [1, 1, 5], 23), ([3], [1], 8)]
)
def test_every_epoch_has_exactly_the_counts(sizes: list[int], weights: list[int], length: int | None) -> None:
    """Exact per-epoch counts for weights that do and do not divide L (here both), and n_i > N_i:
    every record q_i times plus r_i distinct extras."""
    plan = MixturePlan.create(sizes, weights, epoch_size=length, seed=3)
    for e in range(25):
        pairs = plan.pairs(e)
        assert pairs.shape == (plan.epoch_size, 2) and pairs.dtype == np.int64
        ds = pairs[:, 0]
        assert tuple(np.bincount(ds, minlength=len(sizes))) == plan.counts
        for i, (n, c) in enumerate(zip(sizes, plan.counts)):
            uses = np.bincount(pairs[ds == i, 1], minlength=n)
            assert uses.size == n
            q, r = divmod(c, n)
            assert sorted(uses.tolist()) == [q] * (n - r) + [q + 1] * r


# ---------------------------------------------------------------------------------------------- walks
@pytest.mark.parametrize("n,r", [(5, 3), (4, 3), (7, 2), (6, 4), (10, 1), (9, 6), (2, 1)])
def test_walks_use_every_record_once_before_any_twice(n: int, r: int) -> None:
    """The extras stream is walk 0, walk 1, ... (each a permutation), every epoch's extras are distinct,
    and the result does not depend on the order epochs are asked for (resume at any epoch)."""
    epochs = 6 * n
    w = Walks(11, 2, n, r)
    extras = np.concatenate([w.epoch(e) for e in range(epochs)])
    for e in range(epochs):
        assert np.unique(extras[e * r : (e + 1) * r]).size == r
    walks = extras[: (extras.size // n) * n].reshape(-1, n)
    for k, row in enumerate(walks):
        assert sorted(row.tolist()) == list(range(n))
        np.testing.assert_array_equal(row, Walks(11, 2, n, r).walk(k))
    # Balance at every epoch boundary: cumulative uses differ by at most one.
    for e in range(1, epochs + 1):
        uses = np.bincount(extras[: e * r], minlength=n)
        assert uses.max() - uses.min() <= 1
    backwards = Walks(11, 2, n, r)
    np.testing.assert_array_equal(np.concatenate([backwards.epoch(e) for e in reversed(range(epochs))][::-1]), extras)
    scattered = Walks(11, 2, n, r)
    for e in np.random.default_rng(0).permutation(epochs)[:10]:
        np.testing.assert_array_equal(scattered.epoch(int(e)), extras[e * r : (e + 1) * r])


def test_walk_bounds() -> None:
    # N = 4, r = 3: walk 0 ends with 1 record of epoch 1, walk 1 holds 2 of epoch 1 and 2 of epoch 2, ...
    assert [walk_bounds(w, 4, 3) for w in range(4)] == [(0, 1), (2, 2), (1, 0), (0, 1)]
    for n, r in [(5, 3), (7, 2), (9, 6)]:
        for w in range(20):
            h, t = walk_bounds(w, n, r)
            assert h + t <= n
            if t:
                assert walk_bounds(w + 1, n, r)[0] + t == r


def _chi2_uniform(outcomes: list[object], cells: int) -> float:
    counts = Counter(outcomes)
    assert len(counts) <= cells
    obs = np.array(list(counts.values()) + [0] * (cells - len(counts)), dtype=float)
    return float(stats.chisquare(obs).pvalue)


def test_straddling_walks_have_the_conditioned_uniform_law() -> None:
    """N = 4, r = 3: walk 1 must start with 2 records outside walk 0's last one. The pair (walk 0,
    walk 1) is uniform over the 24 * 12 admissible pairs of permutations (independent permutations
    conditioned on no epoch repeating a record). A variant that takes walk 1's head as the first
    two keys of a fresh permutation not in the tail (keeping the rest of it in order) fails
    (p ~ 1e-280): records used last in walk 0 then come early in walk 1."""
    outcomes = []
    for seed in range(288 * 25):
        w = Walks(seed, 0, 4, 3)
        a, b = w.walk(0), w.walk(1)
        assert b[0] != a[3] and b[1] != a[3]
        outcomes.append((tuple(a), tuple(b)))
    assert _chi2_uniform(outcomes, 24 * 12) > ALPHA


def test_one_epoch_is_a_uniform_arrangement_of_a_uniform_subset() -> None:
    """Sizes (3, 2), weights 1:1, L = 4: dataset 0 gives a 2-subset of 3, dataset 1 both records, and
    the 4 slots are in uniform order: 3 * 4! = 72 equally likely outcomes (epochs 0 and 1)."""
    for epoch in (0, 1):
        outcomes = [tuple(map(tuple, MixturePlan.create([3, 2], [1, 1], 4, seed=s).pairs(epoch))) for s in range(72 * 40)]
        assert _chi2_uniform(outcomes, 72) > ALPHA


def test_dataset_index_sequence_takes_every_arrangement_equally_often() -> None:
    """Counts (3, 2): the 10 sequences of dataset indices are equally likely, at epoch 0 and epoch 5."""
    for epoch in (0, 5):
        outcomes = [tuple(MixturePlan.create([4, 4], [3, 2], 5, seed=s).pairs(epoch)[:, 0]) for s in range(2000)]
        assert _chi2_uniform(outcomes, math.comb(5, 2)) > ALPHA


def test_the_arrangement_is_the_slot_order_and_walks_draw_from_the_mixture_domain() -> None:
    """The slots are arranged by the single-dataset epoch permutation (its own domain) applied to
    the item table; the walks draw from the mixture's domain."""
    plan = MixturePlan.create([6, 4], [1, 2], 30, seed=4)
    items = np.concatenate([off + plan.dataset_keys(i, 7) for i, off in enumerate(plan.offsets[:-1].tolist())])
    np.testing.assert_array_equal(plan.stream(7), items[rng(Domain.EPOCH_ORDER, 4, 7).permutation(30)])
    w = Walks(4, 1, 10, 3)
    # Walk 0 begins on an epoch boundary: no head; its first epoch is its first three records.
    np.testing.assert_array_equal(w.epoch(0), w.walk(0)[:3])
    # Walk 1 (3 keys of epoch 3 straddle) draws its head from part HEAD with (dataset, walk).
    g = rng(Domain.MIXTURE, 4, HEAD, 1, 1)
    tail = w.walk(0)[9:]
    head = g.choice(9, size=2, replace=False)
    head = head + (head >= tail[0])
    np.testing.assert_array_equal(w.epoch(3), np.concatenate([tail, head]))


# ---------------------------------------------------------------------------------------------- statistics
def test_within_each_dataset_the_order_is_uniform() -> None:
    """Item x position chi-square (scaled (N-1)/N) of each dataset's records in its slots, over many
    epochs of one seed, for datasets with n_i = N_i (permutations) and the positions of the
    dataset-A slots."""
    plan = MixturePlan.create([12, 12], [1, 1], seed=21)
    rows = [[], []]
    for e in range(3000):
        pairs = plan.pairs(e)
        for i in (0, 1):
            rows[i].append(pairs[pairs[:, 0] == i, 1])
    for i in (0, 1):
        assert item_position_pvalue(np.array(rows[i])) > ALPHA


def test_uniform_subset_positions_when_the_dataset_is_undersampled() -> None:
    """n_i < N_i: every record is included equally often (walks), and which record sits in which of
    the dataset's slots is uniform: the item x position statistic for rows of k < N distinct keys
    (shardkit.ordertest.stats, interaction part, scaled (N-1)/N) is chi2((N-1)(k-1))."""
    plan = MixturePlan.create([10, 30], [1, 1], epoch_size=20, seed=8)  # n = (10, 10): dataset 1 at 1/3
    epochs, n, k = 3000, 30, 10
    rows = []
    for e in range(epochs):
        pairs = plan.pairs(e)
        rows.append(pairs[pairs[:, 0] == 1, 1])
    inclusion = np.bincount(np.concatenate(rows), minlength=n)
    assert inclusion.max() - inclusion.min() <= 1  # 3000 epochs * 10 extras = 1000 walks of 30
    table = ots.position_table(np.array(rows), n, n, k)
    x2, _ = ots.item_position_statistic(table, n, k, epochs)
    assert stats.chi2.sf(x2, (n - 1) * (k - 1)) > ALPHA


def test_runs_of_the_dataset_index_sequence() -> None:
    """Wald-Wolfowitz: the number of runs of A/B slots has mean 1 + 2ab/L and variance
    2ab(2ab - L) / (L^2 (L - 1)) under a uniform arrangement; summed over epochs it is normal. A
    variant that interleaves the datasets evenly (A B A B ...) fails at z ~ 77."""
    a, b = 30, 10
    plan = MixturePlan.create([40, 40], [a, b], epoch_size=a + b, seed=4)
    length, epochs = a + b, 2000
    runs = [int(np.count_nonzero(np.diff(plan.pairs(e)[:, 0])) + 1) for e in range(epochs)]
    mean = 1 + 2 * a * b / length
    var = 2 * a * b * (2 * a * b - length) / (length**2 * (length - 1))
    z = (sum(runs) - epochs * mean) / math.sqrt(epochs * var)
    assert 2 * stats.norm.sf(abs(z)) > ALPHA


def test_positions_of_dataset_slots_are_uniform() -> None:
    """Dataset x position table over epochs (every slot position, counts (6, 3, 1)): the Pearson
    statistic scaled by (L-1)/L is chi2((m-1)(L-1)), as for item x position."""
    plan = MixturePlan.create([6, 3, 1], [6, 3, 1], seed=17)
    length, epochs = plan.epoch_size, 4000
    table = np.zeros((3, length))
    for e in range(epochs):
        table[plan.pairs(e)[:, 0], np.arange(length)] += 1
    expected = epochs * np.array(plan.counts)[:, None] / length * np.ones((1, length))
    x2 = float(((table - expected) ** 2 / expected).sum()) * (length - 1) / length
    assert stats.chi2.sf(x2, 2 * (length - 1)) > ALPHA


def test_consecutive_epochs_are_independent() -> None:
    """Arrangements: the dataset x dataset table of slot p in epochs e and e+1 (disjoint pairs of
    epochs) is what independent uniform arrangements give (scaled chi2((m-1)^2) per pair, summed).
    Orders: a dataset with n_i = N_i has uncorrelated positions of a record in consecutive epochs."""
    plan = MixturePlan.create([8, 8], [1, 1], seed=31)
    total, df = 0.0, 0
    corr = []
    for e in range(0, 2000, 2):
        p0, p1 = plan.pairs(e), plan.pairs(e + 1)
        t = np.zeros((2, 2))
        np.add.at(t, (p0[:, 0], p1[:, 0]), 1)
        exp = np.outer(t.sum(1), t.sum(0)) / 16
        total += float(((t - exp) ** 2 / exp).sum()) * 15 / 16
        df += 1
        pos0 = np.argsort(p0[:, 1] + 100 * p0[:, 0])[:8]
        pos1 = np.argsort(p1[:, 1] + 100 * p1[:, 0])[:8]
        corr.append(np.corrcoef(pos0, pos1)[0, 1])
    assert stats.chi2.sf(total, df) > ALPHA
    z = np.mean(corr) * math.sqrt(len(corr) * 7)  # var of a Pearson r under independence ~ 1/(n-1)
    assert 2 * stats.norm.sf(abs(z)) > ALPHA


def test_stream_is_a_pure_function_of_seed_and_epoch() -> None:
    a = MixturePlan.create([20, 7, 13], [2, 1, 1], epoch_size=50, seed=99)
    b = MixturePlan.create([20, 7, 13], [2, 1, 1], epoch_size=50, seed=99)
    for e in (9, 3, 0, 3, 12):
        np.testing.assert_array_equal(a.stream(e), b.stream(e))
    assert not np.array_equal(a.stream(0), a.stream(1))
    assert not np.array_equal(a.stream(0), MixturePlan.create([20, 7, 13], [2, 1, 1], epoch_size=50, seed=98).stream(0))
    ds, keys = a.split(a.stream(4))
    np.testing.assert_array_equal(np.stack([ds, keys], 1), a.pairs(4))
    np.testing.assert_array_equal(a.global_keys(ds, keys), a.stream(4))


@pytest.mark.parametrize("mode,permutation", [("epoch", "exact"), ("epoch", "feistel"), ("replacement", "exact"),
                                              ("sequential", "exact")])
def test_the_plan_of_one_dataset_is_the_single_dataset_order(mode: str, permutation: str) -> None:
    """One dataset read once per epoch: the item table is slot -> slot, so the plan's order is the
    single-dataset order itself, bit for bit, in every mode (the sampler reads every source so)."""
    for n in (1, 7, 1000):
        plan = MixturePlan.create([n], [1], None, seed=11)
        assert plan.single
        for epoch in (0, 3):
            slots = epoch_order(mode, 11, epoch, n, reservoir=5, permutation=permutation)
            positions = np.arange(n, dtype=np.int64)
            np.testing.assert_array_equal(plan.slot_keys(epoch, slots.keys(positions)), slots.keys(positions))
        np.testing.assert_array_equal(plan.stream(2), epoch_permutation(11, 2, n))
    assert not MixturePlan.create([5], [1], 10).single and not MixturePlan.create([5, 5], [1, 1]).single
