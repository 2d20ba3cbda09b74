"""The on-demand epoch order (a keyed Feistel bijection with cycle walking) for datasets too large for
an exact permutation: a bijection of range(n) for every n, statistically uniform by the same proof
tests as the exact order, and what the sampler emits with ``permutation="feistel"`` (and ``"auto"``
past the size limit).

Statistical tests use alpha = 1e-3 and fixed seeds. Checked once against weakened networks: with 2
rounds instead of 8, the item x position, ordered adjacent pair and storage neighbour tests all fail
at N = 10 and N = 37 (p < 1e-300); 3 and 4 rounds pass these sample sizes, which is why the network
uses 8 (Patarin's bound wants at least 6).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.errors import SamplerError
from shardkit.order import schedule
from shardkit.order.bijection import ROUNDS, FeistelPermutation
from shardkit.order.schedule import BijectionOrder, epoch_order, resolve_permutation
from shardkit.readers import TieredSampler
from shardkit.tiers.static_cache import BijectionKeys
from tests.helpers.order_stats import ALPHA, item_position_pvalue, om
from tests.helpers.sampler_data import check_batch, collect, make_dataset


def _orders(seed: int, n: int, epochs: int) -> np.ndarray:
    return np.stack([FeistelPermutation.for_epoch(seed, e, n)(np.arange(n)) for e in range(epochs)])


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000, 4097, 100_003])
def test_a_bijection_of_range_n(n: int) -> None:
    f = FeistelPermutation.for_epoch(7, 1, n)
    p = f(np.arange(n))
    assert p.dtype == np.int64 and np.array_equal(np.sort(p), np.arange(n))
    domain = np.arange(1 << (2 * f.half), dtype=np.uint64)
    np.testing.assert_array_equal(f.inverse_network(f._network(domain)), domain)  # the network is invertible
    np.testing.assert_array_equal(f(np.array([n - 1, 0])), p[[n - 1, 0]])  # any positions, any order
    with pytest.raises(IndexError):
        f(np.array([n]))


def test_round_keys_come_from_their_own_domain() -> None:
    a, b = FeistelPermutation.for_epoch(1, 0, 100), FeistelPermutation.for_epoch(1, 1, 100)
    assert a.keys.shape == (ROUNDS,) and not np.array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.keys, FeistelPermutation.for_epoch(1, 0, 100).keys)
    assert not np.array_equal(a(np.arange(100)), b(np.arange(100)))


@pytest.mark.parametrize("n,epochs", [(10, 4000), (37, 3000)])
def test_item_position_uniform(n: int, epochs: int) -> None:
    """Item x position chi-square over epochs (scaled by (N-1)/N, (N-1)^2 dof); consecutive epochs
    uncorrelated."""
    orders = _orders(11, n, epochs)
    assert item_position_pvalue(orders) > ALPHA
    positions = np.argsort(orders, axis=1)
    r = np.array([np.corrcoef(positions[e], positions[e + 1])[0, 1] for e in range(epochs - 1)])
    z = r.mean() * math.sqrt((n - 1) * (epochs - 1))
    assert 2 * stats.norm.sf(abs(z)) > ALPHA


@pytest.mark.parametrize("n,epochs", [(10, 6000), (37, 16000)])
def test_adjacent_pairs_uniform(n: int, epochs: int) -> None:
    """The key at p and the key at p + 1 form a uniform ordered pair of distinct keys: chi-square with
    N(N-1) - 1 dof at three positions (independent epochs each; Bonferroni over the three), and
    storage neighbours are emitted next to each other as often as under a uniform shuffle."""
    orders = _orders(13, n, epochs)
    cells = n * (n - 1)
    pvalues = []
    for p in (0, n // 2, n - 2):
        a, b = orders[:, p], orders[:, p + 1]
        assert not np.any(a == b)
        code = a * (n - 1) + np.where(b > a, b - 1, b)  # ordered distinct pairs -> 0 .. N(N-1)-1
        counts = np.bincount(code, minlength=cells).astype(float)
        pvalues.append(stats.chisquare(counts).pvalue)
    assert min(pvalues) * 3 > ALPHA
    assert om.adjacent_pairs_test(orders, n, block=4).pvalue > ALPHA


def test_sampler_emits_the_bijection(tmp_path: Path, ssd_dir: Path) -> None:
    """permutation="feistel": every epoch is the bijection's order, each record once, read once."""
    n = 29
    ds = make_dataset(tmp_path / "ds", n)
    for tiers in ("ram", "ram,ssd"):
        s = TieredSampler(ds, tiers=tiers, ram_size="6records", ssd_size="10records", ssd_dir=ssd_dir, batch_size=4,
                          epochs=3, seed=3, permutation="feistel", static_cache=0)  # fmt: skip
        keys = np.concatenate(collect(s)).reshape(3, n)
        for e in range(3):
            np.testing.assert_array_equal(keys[e], FeistelPermutation.for_epoch(3, e, n)(np.arange(n)))
        assert s.permutation == "feistel" and s.stats.disk.records == 3 * n
        assert s.state_dict()["permutation"] == "feistel"


def test_auto_switches_past_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_permutation("auto", schedule.EXACT_PERMUTATION_LIMIT) == "exact"
    assert resolve_permutation("auto", schedule.EXACT_PERMUTATION_LIMIT + 1) == "feistel"
    assert isinstance(epoch_order("epoch", 1, 0, 20, permutation="feistel"), BijectionOrder)
    ds = make_dataset(tmp_path / "ds", 20)
    monkeypatch.setattr(schedule, "EXACT_PERMUTATION_LIMIT", 19)
    s = TieredSampler(ds, batch_size=3, seed=4, ram_size="8records", static_cache="5records")
    assert s.permutation == "feistel" and s._cache is not None and s._cache.variant == "bijection"
    keys = np.concatenate(collect(s))
    np.testing.assert_array_equal(keys, FeistelPermutation.for_epoch(4, 0, 20)(np.arange(20)))
    assert s.pinned_keys.size == 5 and np.array_equal(s.pinned_keys, np.sort(s.pinned_keys))


def test_resume_keeps_the_permutation(tmp_path: Path) -> None:
    n = 31
    ds = make_dataset(tmp_path / "ds", n)
    kw = dict(ram_size="6records", batch_size=3, epochs=1, seed=6, permutation="feistel")
    s = TieredSampler(ds, rank=0, world_size=2, **kw)  # type: ignore[arg-type]
    head = [check_batch(b) for _, b in zip(range(2), s)]
    state = s.state_dict()
    s.close()
    other = TieredSampler(ds, rank=0, world_size=3, **kw)  # type: ignore[arg-type]
    other.load_state_dict(state)
    tail = collect(other)
    pi = FeistelPermutation.for_epoch(6, 0, n)(np.arange(n))
    np.testing.assert_array_equal(np.concatenate(head), np.concatenate([pi[0:3], pi[6:9]]))
    np.testing.assert_array_equal(np.concatenate(tail), np.concatenate([pi[12 + 9 * g : 15 + 9 * g] for g in range(3)]))
    exact = TieredSampler(ds, ram_size="6records", batch_size=3, seed=6)
    with pytest.raises(SamplerError, match="feistel permutation"):
        exact.load_state_dict(state)


def test_bijection_pinned_set_is_uniform() -> None:
    """P = preimage of [0, M) under a keyed bijection: inclusion counts over many seeds pass a
    chi-square with N - 1 dof; hits and rows agree with the set."""
    n, m, trials = 20, 5, 4000
    counts = np.zeros(n)
    for seed in range(trials):
        pinned = BijectionKeys(seed, n, m)
        keys = pinned.keys()
        assert keys.size == m
        hit, row = pinned.lookup(np.arange(n))
        assert np.array_equal(np.flatnonzero(hit), keys) and sorted(row[hit].tolist()) == list(range(m))
        counts[keys] += 1
    assert stats.chisquare(counts).pvalue > ALPHA
