"""Epoch mode through the real tier stack: exactly once, and an exactly uniform order.

Statistical tests use alpha = 1e-3 and fixed seeds. They were checked once against broken samplers:
a 4-record buffer shuffle over storage order fails the item x position tests (p ~ 1e-250 through
RAM, 1e-80 through SSD) and the 5! orders test (p ~ 1e-87) (for N = 4 a 4-record buffer *is* a
uniform shuffle, so that test cannot and does not notice); one permutation reused every epoch
fails the item x position / independence test.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.readers import TieredSampler, epoch_permutation
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import collect, epochs_of, make_dataset

# tests/serve/test_shared.py imports the statistic under this name.
_item_position_pvalue = item_position_pvalue

# (tiers, ram_size, ssd_size): RAM blocks of 2-3 records, SSD reservoirs of 4-5 records, so every
# epoch crosses several reservoir and block boundaries. The static cache is off: these tests prove
# the uncached contract (every record read once per epoch); a budget that covers a tiny dataset
# would otherwise cache it whole (tests/order/test_block_schedule.py proves the cached stacks).
STACKS = {
    "ram": dict(tiers="ram", ram_size="6records", static_cache=0),
    "ram+ssd": dict(tiers="ram,ssd", ram_size="4records", ssd_size="10records", static_cache=0),
}


def _sampler(path: Path, stack: str, ssd_dir: Path, **kw: object) -> TieredSampler:
    return TieredSampler(path, ssd_dir=ssd_dir, **STACKS[stack], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("n,batch", [(23, 5), (20, 4), (7, 10), (1, 3)])
def test_exactly_once_per_epoch(tmp_path: Path, ssd_dir: Path, stack: str, n: int, batch: int) -> None:
    """Every record once per epoch, across reservoir, block and epoch boundaries and ragged tails;
    the emitted order is the documented pi."""
    ds = make_dataset(tmp_path / "ds", n)
    s = _sampler(ds, stack, ssd_dir, batch_size=batch, epochs=3, seed=5)
    batches = collect(s)
    sizes = [b.size for b in batches]
    per_epoch = [batch] * (n // batch) + ([n % batch] if n % batch else [])
    assert sizes == per_epoch * 3  # only the last batch of an epoch is short
    assert len(s) == len(per_epoch)
    keys = np.concatenate(batches).reshape(3, n)
    for e in range(3):
        np.testing.assert_array_equal(keys[e], epoch_permutation(5, e, n))
        assert sorted(keys[e].tolist()) == list(range(n))
    assert s.state_dict()["epoch"] == 3 and s.state_dict()["position"] == 0
    assert s.stats.records == 3 * n
    assert s.stats.disk.records == 3 * n  # each record read from disk once per epoch
    if stack == "ram+ssd":
        assert s.stats.ssd.records == 3 * n
        assert s.ram_block == 2 and s.ssd_block == min(5, math.ceil(n / batch) * batch)


@pytest.mark.parametrize("stack", list(STACKS))
def test_drop_last_and_restart(tmp_path: Path, ssd_dir: Path, stack: str) -> None:
    ds = make_dataset(tmp_path / "ds", 23)
    s = _sampler(ds, stack, ssd_dir, batch_size=5, epochs=1, seed=1, drop_last=True)
    first = collect(s)
    assert [b.size for b in first] == [5] * 4 and len(s) == 4
    np.testing.assert_array_equal(np.concatenate(first), epoch_permutation(1, 0, 23)[:20])
    second = collect(s)  # iterating again continues with the next epoch
    np.testing.assert_array_equal(np.concatenate(second), epoch_permutation(1, 1, 23)[:20])
    s.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate(collect(s)), np.concatenate(first))


@pytest.mark.parametrize("stack,epochs", [("ram", 1500), ("ram+ssd", 400)])
def test_item_position_uniform(tmp_path: Path, ssd_dir: Path, stack: str, epochs: int) -> None:
    """Item x position table over many epochs: the scaled chi-square with (N-1)^2 dof. Also: consecutive
    epochs independent (mean position correlation ~ 0) and storage order unrelated to emitted
    order (Spearman ~ 0)."""
    n = 8
    ds = make_dataset(tmp_path / "ds", n)
    orders = epochs_of(_sampler(ds, stack, ssd_dir, batch_size=3, epochs=epochs, seed=11), n)
    assert orders.shape == (epochs, n)
    assert (np.sort(orders, axis=1) == np.arange(n)).all()
    assert item_position_pvalue(orders) > ALPHA

    # positions[e, i] = where item i was emitted in epoch e
    positions = np.argsort(orders, axis=1)
    r = np.array([np.corrcoef(positions[e], positions[e + 1])[0, 1] for e in range(epochs - 1)])
    # Under independence each r has mean 0 and variance 1/(N-1); pairs are uncorrelated.
    z = r.mean() * math.sqrt((n - 1) * (epochs - 1))
    assert 2 * stats.norm.sf(abs(z)) > ALPHA
    # Spearman between storage position (= key) and emitted position, pooled over epochs.
    rho = stats.spearmanr(np.tile(np.arange(n), epochs), positions.reshape(-1)).statistic
    z = rho * math.sqrt(n * epochs - 1)  # rho ~ N(0, 1/(n-1)) under independence (approximately)
    assert 2 * stats.norm.sf(abs(z)) > ALPHA


@pytest.mark.parametrize("n,per_order", [(4, 40), (5, 20)])
def test_all_orders_equally_frequent(tmp_path: Path, ssd_dir: Path, n: int, per_order: int) -> None:
    """All N! orders equally frequent: chi-square with N! - 1 dof."""
    ds = make_dataset(tmp_path / "ds", n)
    epochs = math.factorial(n) * per_order
    orders = epochs_of(_sampler(ds, "ram", ssd_dir, batch_size=2, epochs=epochs, seed=13), n)
    counts = Counter(map(tuple, orders.tolist()))
    observed = np.array([counts.get(p, 0) for p in itertools.permutations(range(n))], dtype=float)
    assert observed.sum() == epochs  # nothing but permutations came out
    assert stats.chisquare(observed).pvalue > ALPHA


def test_all_orders_through_ssd(tmp_path: Path, ssd_dir: Path) -> None:
    """N = 4 through the SSD tier (reservoirs of 2, RAM blocks of 1): all 24 orders."""
    n, epochs = 4, 24 * 15
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=2)
    s = TieredSampler(ds, tiers="ssd,ram", ram_size="2records", ssd_size="4records", ssd_dir=ssd_dir,
                      batch_size=3, epochs=epochs, seed=17)
    assert (s.ram_block, s.ssd_block) == (1, 2)
    orders = epochs_of(s, n)
    counts = Counter(map(tuple, orders.tolist()))
    observed = np.array([counts.get(p, 0) for p in itertools.permutations(range(n))], dtype=float)
    assert observed.sum() == epochs
    assert stats.chisquare(observed).pvalue > ALPHA


@pytest.mark.parametrize("stack", list(STACKS))
def test_rank_slices_disjoint_and_covering(tmp_path: Path, ssd_dir: Path, stack: str) -> None:
    n, b, w = 37, 4, 3
    ds = make_dataset(tmp_path / "ds", n)
    per_rank = []
    for r in range(w):
        s = _sampler(ds, stack, ssd_dir, batch_size=b, epochs=2, seed=3, rank=r, world_size=w)
        batches = collect(s)
        assert len(batches) == 2 * len(s)
        per_rank.append(batches)
    for e in range(2):
        pi = epoch_permutation(3, e, n)
        lens = [len(per_rank[r]) // 2 for r in range(w)]
        # Global batch g is the concatenation of every rank's g-th batch, in rank order.
        rebuilt = []
        for g in range(max(lens)):
            for r in range(w):
                if g < lens[r]:
                    rebuilt.append(per_rank[r][e * lens[r] + g])
        np.testing.assert_array_equal(np.concatenate(rebuilt), pi)
    assert [len(p) // 2 for p in per_rank] == [4, 3, 3]  # 37 = 3 * 12 + 1: only rank 0 gets the tail
    # drop_last: every rank the same number of full batches
    counts = {len(_sampler(ds, stack, ssd_dir, batch_size=b, rank=r, world_size=w, drop_last=True)) for r in range(w)}
    assert counts == {3}


def test_each_consumer_reads_only_its_keys(tmp_path: Path, ssd_dir: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 40)
    s = _sampler(ds, "ram+ssd", ssd_dir, batch_size=4, rank=1, world_size=4, seed=2)
    keys = np.concatenate(collect(s))
    pi = epoch_permutation(2, 0, 40)
    np.testing.assert_array_equal(keys, np.concatenate([pi[4:8], pi[20:24], pi[36:40]]))  # 40 = 2 * 16 + 8
    assert s.stats.disk.records == 12 and s.stats.ssd.records == 12
