"""Replacement and sequential modes through the tier stack."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.readers import TieredSampler, epoch_stream
from tests.helpers.order_stats import ALPHA
from tests.helpers.sampler_data import collect, make_dataset


@pytest.mark.parametrize("tiers,kw", [("ram", {"ram_size": "8records"}), ("ram,ssd", {"ram_size": "4records", "ssd_size": "8records"})])
def test_replacement_inclusion_frequencies(tmp_path: Path, ssd_dir: Path, tiers: str, kw: dict) -> None:
    """Each reservoir is a uniform K-subset: per-reservoir inclusion counts pass a chi-square with
    N - 1 dof (scaled for sampling without replacement inside a reservoir); no duplicates inside a
    reservoir; reservoirs of different epochs differ."""
    n = 10
    ds = make_dataset(tmp_path / "ds", n)
    epochs = 300 if tiers == "ram" else 120
    s = TieredSampler(ds, tiers=tiers, ssd_dir=ssd_dir, batch_size=3, epochs=epochs, seed=7, mode="replacement", **kw)
    k = s.reservoir_size
    assert k == 4
    keys = np.concatenate(collect(s)).reshape(epochs, n)
    reservoirs = [keys[e, a : a + k] for e in range(epochs) for a in range(0, n - k + 1, k)]  # whole reservoirs only
    for r in reservoirs:
        assert len(set(r.tolist())) == k
    counts = np.bincount(np.concatenate(reservoirs), minlength=n).astype(float)
    t, p = len(reservoirs), k / n
    stat = ((counts - t * k / n) ** 2 / (t * k / n)).sum() / ((1 - p) * n / (n - 1))
    assert stats.chi2.sf(stat, n - 1) > ALPHA
    # Matches the documented stream, and is not an epoch-mode permutation.
    np.testing.assert_array_equal(keys[0], epoch_stream("replacement", 7, 0, n, k))
    assert any(len(set(row.tolist())) < n for row in keys)


def test_replacement_test_has_power(tmp_path: Path) -> None:
    """The same statistic rejects a reservoir that always keeps the first K keys it saw plus noise."""
    n, k, t = 10, 4, 1000
    rng = np.random.default_rng(0)
    reservoirs = [np.concatenate([[0, 1], rng.choice(np.arange(2, n), 2, replace=False)]) for _ in range(t)]
    counts = np.bincount(np.concatenate(reservoirs), minlength=n).astype(float)
    p = k / n
    stat = ((counts - t * p) ** 2 / (t * p)).sum() / ((1 - p) * n / (n - 1))
    assert stats.chi2.sf(stat, n - 1) < ALPHA


@pytest.mark.parametrize("tiers", ["ram", "ssd,ram"])
def test_sequential_mode(tmp_path: Path, ssd_dir: Path, tiers: str) -> None:
    ds = make_dataset(tmp_path / "ds", 17)
    s = TieredSampler(ds, tiers=tiers, ram_size="4records", ssd_size="6records", ssd_dir=ssd_dir,
                      batch_size=3, epochs=2, mode="sequential", rank=1, world_size=2)
    keys = np.concatenate(collect(s))
    one = np.array([3, 4, 5, 9, 10, 11, 15, 16], dtype=np.int64)
    np.testing.assert_array_equal(keys, np.concatenate([one, one]))


def test_limit_and_element_spec(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 20)
    s = TieredSampler(ds, ram_size="4records", batch_size=3, epochs=3, limit=25, seed=1)
    batches = collect(s)
    assert sum(b.size for b in batches) == 25 and batches[-1].size == 2  # 20 = 6*3 + 2, then 3 + 2
    assert s.stats.disk.records == 25  # nothing beyond the limit is read
    st = s.state_dict()
    assert (st["epoch"], st["position"]) == (1, 5)
    rest = np.concatenate(collect(s))  # continues where the limit stopped
    full = np.concatenate([epoch_stream("epoch", 1, e, 20) for e in range(3)])
    np.testing.assert_array_equal(np.concatenate([*batches, rest]), full[: 25 + rest.size])
    spec = s.element_spec()
    assert spec["image"] == ((4, 4, 1), np.dtype("uint8"))
    assert spec["label"] == ((), np.dtype("int64")) and spec["pair"] == ((2,), np.dtype("float32"))
    assert spec["key"] == ((), np.dtype("int64"))
