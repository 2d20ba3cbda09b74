"""Every random use of the sampler draws from its own shardkit.order.seeds domain.

Seeds are integers in [0, 2**64): numpy's SeedSequence splits integers into 32-bit words, so the former
seeding ``default_rng([seed, epoch])`` made seed ``5 + 3 * 2**32`` at epoch 0 the very stream of seed 5 at
epoch 3, and replacement reservoirs ``[seed, epoch, 1]`` of one seed the epoch order of another. The
domains encode (domain, values) unambiguously. Statistical tests: alpha = 1e-3, fixed seeds, and the
default configuration (seed 0, every option at its default) through the real sampler.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.errors import ConfigError, SamplerError
from shardkit.order.schedule import replacement_stream
from shardkit.order.seeds import Domain, rng
from shardkit.readers import DEFAULTS, SamplerOptions, TieredSampler, epoch_permutation, epoch_stream
from shardkit.readers.sampler import STATE_VERSION
from shardkit.tiers.static_cache import pinned_keys
from tests.helpers.order_stats import ALPHA, item_position_chi2, item_position_pvalue
from tests.helpers.sampler_data import collect, epochs_of, make_dataset

BIG = 5 + 3 * 2**32


def test_seeds_beyond_32_bits_do_not_alias_epochs() -> None:
    n = 64
    assert not np.array_equal(epoch_permutation(BIG, 0, n), epoch_permutation(5, 3, n))
    assert not np.array_equal(replacement_stream(BIG, 0, n, 8), replacement_stream(5, 3, n, 8))
    # What the former seeding did (kept here to show what the test guards against):
    assert np.array_equal(np.random.default_rng([BIG, 0]).permutation(n), np.random.default_rng([5, 3]).permutation(n))


def test_each_use_draws_from_its_own_domain() -> None:
    n, seed, epoch = 50, 9, 2
    np.testing.assert_array_equal(epoch_permutation(seed, epoch, n), rng(Domain.EPOCH_ORDER, seed, epoch).permutation(n))
    stream = replacement_stream(seed, epoch, n, 10)
    gen = rng(Domain.REPLACEMENT, seed, epoch)
    from shardkit.order.reservoir import reservoir_keys

    np.testing.assert_array_equal(stream, np.concatenate([reservoir_keys(n, 10, gen) for _ in range(5)]))
    np.testing.assert_array_equal(
        pinned_keys(seed, n, 7), np.sort(rng(Domain.STATIC_CACHE, seed).choice(n, size=7, replace=False))
    )
    # The former replacement stream of seed s at epoch e was the epoch order of seed s + e * 2**32
    # at epoch 1; with domains the two are unrelated.
    old = np.random.default_rng([seed, epoch, 1]).permutation(n)
    assert np.array_equal(old, np.random.default_rng([seed + epoch * 2**32, 1]).permutation(n))
    assert not np.array_equal(epoch_permutation(seed + epoch * 2**32, 1, n), rng(Domain.REPLACEMENT, seed, epoch).permutation(n))


def test_largest_seed_runs_and_larger_ones_are_refused(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 11)
    top = 2**64 - 1
    s = TieredSampler(ds, batch_size=4, seed=top, epochs=2)
    keys = np.concatenate(collect(s)).reshape(2, 11)
    for e in range(2):
        np.testing.assert_array_equal(keys[e], epoch_permutation(top, e, 11))
    assert s.state_dict()["seed"] == top
    with pytest.raises(ConfigError, match=r"^seed: expected an integer in \[0, 2\*\*64\)"):
        TieredSampler(ds, seed=2**64)
    with pytest.raises(ConfigError, match=r"^seed: "):
        TieredSampler(ds, seed=-1)


def test_static_cache_and_replacement_with_big_seeds(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 20)
    a = TieredSampler(ds, seed=BIG, static_cache="5records", mode="replacement", ram_size="8records", batch_size=3)
    b = TieredSampler(ds, seed=5, static_cache="5records", mode="replacement", ram_size="8records", batch_size=3)
    np.testing.assert_array_equal(a.pinned_keys, pinned_keys(BIG, 20, 5))
    ka = np.concatenate(collect(a))
    np.testing.assert_array_equal(ka, epoch_stream("replacement", BIG, 0, 20, a.reservoir_size))
    a.set_epoch(0), b.set_epoch(3)
    assert not np.array_equal(ka, np.concatenate(collect(b)))


def test_state_dicts_of_the_former_orders_are_refused(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    s = TieredSampler(ds, batch_size=2, seed=1)
    state = s.state_dict()
    assert state["version"] == STATE_VERSION == 2
    with pytest.raises(SamplerError, match=r"version 1 was saved by an older shardkit.*cannot continue that order"):
        s.load_state_dict({**state, "version": 1})
    with pytest.raises(SamplerError, match="expected version 2, found 3"):
        s.load_state_dict({**state, "version": 3})


# ------------------------------------------------------------------ the default configuration, statistically
def test_default_configuration_is_uniform(tmp_path: Path) -> None:
    """seed 0 and every other option at its default (batch 256, 512 MiB RAM, tiers ram, epoch mode):
    the item x position chi-square over 1500 epochs of N = 8, consecutive epochs uncorrelated."""
    n, epochs = 8, 1500
    ds = make_dataset(tmp_path / "ds", n)
    s = TieredSampler(ds, epochs=epochs)
    assert s.options == DEFAULTS.replace(epochs=epochs) and s.seed == 0
    orders = epochs_of(s, n)
    assert orders.shape == (epochs, n)
    assert item_position_pvalue(orders) > ALPHA
    positions = np.argsort(orders, axis=1)
    r = np.array([np.corrcoef(positions[e], positions[e + 1])[0, 1] for e in range(epochs - 1)])
    z = r.mean() * math.sqrt((n - 1) * (epochs - 1))
    assert 2 * stats.norm.sf(abs(z)) > ALPHA


def test_default_configuration_gives_every_order_equally_often(tmp_path: Path) -> None:
    """N = 4 with the default options: all 24 orders equally frequent (chi-square, 23 dof)."""
    n, per_order = 4, 40
    ds = make_dataset(tmp_path / "ds", n)
    epochs = math.factorial(n) * per_order
    orders = epochs_of(TieredSampler(ds, SamplerOptions(epochs=epochs)), n)
    counts = Counter(map(tuple, orders.tolist()))
    observed = np.array([counts.get(p, 0) for p in itertools.permutations(range(n))], dtype=float)
    assert observed.sum() == epochs
    assert stats.chisquare(observed).pvalue > ALPHA


# ------------------------------------------------------------------ the statistic itself
def test_scaled_item_position_chi_square_holds_its_level() -> None:
    """The test helper's statistic on exact uniform permutations (N = 8, 1500 epochs, as above): its
    mean is (N-1)^2 and its p-values are uniform. Unscaled, the mean is N(N-1) and p-values pile up
    near 0 (false alarms)."""
    n, epochs, trials = 8, 1500, 300
    gen = rng(Domain.ORDER_TEST, 0, 1)
    results = [item_position_chi2(np.argsort(gen.random((epochs, n)), axis=1)) for _ in range(trials)]
    statistic = np.array([r.statistic for r in results])
    assert all(r.dof == (n - 1) ** 2 for r in results)
    # mean (N-1)^2 = 49 with standard error sqrt(2 * 49 / trials) ~ 0.57
    assert abs(statistic.mean() - (n - 1) ** 2) < 4 * math.sqrt(2 * (n - 1) ** 2 / trials)
    assert stats.kstest([r.pvalue for r in results], "uniform").pvalue > ALPHA
    unscaled = stats.chi2.sf(statistic * n / (n - 1), (n - 1) ** 2)
    assert stats.kstest(unscaled, "uniform").pvalue < ALPHA


def test_a_fresh_samplers_first_epoch_imports_no_numpy_module(tmp_path: Path) -> None:
    """numpy loads ``numpy.random`` on first use: the package imports it, so a fresh sampler's first
    epoch (its first draw of an order) does not pay the import. Checked in a fresh interpreter."""
    import subprocess
    import sys

    path = make_dataset(tmp_path / "ds", 90, records_per_shard=16, shape=(32, 32, 4))
    root = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r})\n"
        "from shardkit.readers import TieredSampler\n"
        f"s = TieredSampler({str(path)!r}, batch_size=8, epochs=1, seed=5, ram_size='270records')\n"
        "before = set(sys.modules)\n"
        "for _ in s:\n    pass\n"
        "s.close()\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'numpy'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
