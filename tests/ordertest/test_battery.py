"""The uniformity battery (``shardkit.ordertest.run``): right under the null, and powerful as stated.

Significance level alpha = 1e-3 throughout, fixed seeds. Uniform orders are numpy permutations;
non-uniform ones come from ``shardkit.ordertest.alternatives`` (what real loaders do) and from weak,
homogeneous perturbations used to check the power figures where they are not trivially met.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from shardkit.errors import ConfigError
from shardkit.ordertest import BATTERY, Report, Settings, alternatives, prepare, run
from shardkit.ordertest import battery as bt

ALPHA = 1e-3
ALL = {t.name for t in BATTERY}


def uniform(n: int, epochs: int, seed: int, k: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([rng.permutation(n)[: k or n] for _ in range(epochs)])


def applied(report: Report) -> set[str]:
    return {r.name for r in report.tested}


# ---------------------------------------------------------------------------------------------- the null
@pytest.mark.parametrize("n,epochs,k,extra,expect", [
    (200, 500, None, {"labels": np.arange(200) * 10 // 200, "batch_size": 64},
     ALL - {"inclusion_frequency", "all_orders"}),
    (8, 1500, None, {}, ALL - {"inclusion_frequency", "all_orders", "labels_per_batch"}),
    (5, 720, None, {}, ALL - {"inclusion_frequency", "labels_per_batch"}),
    (50, 200, 20, {"records": 50, "labels": np.arange(50) % 4, "batch_size": 8}, ALL - {"all_orders"}),
])
def test_uniform_orders_pass(n: int, epochs: int, k: int | None, extra: dict, expect: set[str]) -> None:
    """The battery passes exact shuffles at the defaults (alpha = 1e-3), every applicable test run."""
    report = run(uniform(n, epochs, seed=n + epochs, k=k), **extra)
    assert applied(report) == expect, report.format()
    assert report.passed and report.exit_code == 0, report.format()
    assert all(r.enough for r in report.tested), report.format()


def test_draws_with_replacement_pass_the_tests_that_apply() -> None:
    keys = np.random.default_rng(4).integers(0, 30, size=(20, 100))
    report = run(keys, records=30)
    assert report.kind == "repeats"
    assert applied(report) == {"inclusion_frequency", "storage_spearman"} and report.passed, report.format()


def _pvalues(make: Callable[[np.random.Generator], np.ndarray], runs: int, **kw: object) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(99)
    out: dict[str, list[float]] = {}
    for i in range(runs):
        for r in run(make(rng), compute_power=False, seed=i, **kw).tested:  # type: ignore[arg-type]
            out.setdefault(r.name, []).append(float(r.pvalue))  # type: ignore[arg-type]
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("case", ["permutations", "distinct", "all-orders"])
def test_p_values_are_uniform_and_false_alarms_not_inflated(case: str) -> None:
    """Under the null each test's p-values are Uniform(0, 1) (KS) and the tail is not inflated: the
    rate of p < 0.01 stays within its binomial 1e-4 upper bound and p < 1e-3 (the verdict's level)
    within its Poisson bound over all tests. Includes the labels test's simulated null."""
    if case == "permutations":
        runs, ps = 600, _pvalues(lambda g: np.array([g.permutation(12) for _ in range(60)]), 600,
                                 labels=np.arange(12) % 3, batch_size=4)
    elif case == "distinct":
        runs, ps = 250, _pvalues(lambda g: np.array([g.permutation(30)[:12] for _ in range(60)]), 250,
                                 records=30, labels=np.arange(30) % 4, batch_size=5)
    else:
        runs, ps = 250, _pvalues(lambda g: np.array([g.permutation(4) for _ in range(240)]), 250)
    assert len(ps) >= 5
    low = 0
    for name, p in ps.items():
        assert p.size == runs
        assert stats.kstest(p, "uniform").pvalue > ALPHA, name
        assert (p < 0.01).sum() <= stats.binom.ppf(1 - 1e-4, runs, 0.01), name
        low += int((p < ALPHA).sum())
    assert low <= stats.poisson.ppf(1 - 1e-4, ALPHA * runs * len(ps))


# ---------------------------------------------------------------------------------------------- power
N = 200
B10 = 20  # N / 10: the default reference size


def _rows(make: Callable[[np.random.Generator], np.ndarray], epochs: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([make(rng) for _ in range(epochs)])


ALTERNATIVES: dict[str, tuple[Callable[[np.random.Generator], np.ndarray], set[str]]] = {
    "buffer shuffle N/10": (lambda g: alternatives.buffer_shuffle(g, N, B10),
                            {"item_position", "storage_spearman", "labels_per_batch"}),
    "block shuffle N/10": (lambda g: alternatives.block_shuffle(g, N, B10), {"adjacent_pairs", "joint_positions"}),
    "interleave of 8 shards": (lambda g: alternatives.interleave(g, N, 8), {"item_position", "adjacent_pairs"}),
    "identity": (lambda g: np.arange(N), {"item_position", "storage_spearman", "epoch_independence"}),
}


@pytest.mark.parametrize("name", list(ALTERNATIVES))
def test_each_alternative_is_rejected_by_its_tests_at_the_stated_epochs(name: str) -> None:
    """With exactly the epochs the tool says its designed tests need, they reject."""
    make, designed = ALTERNATIVES[name]
    labels = np.arange(N) * 10 // N
    needed = run(uniform(N, 400, 1), labels=labels, batch_size=64)
    for test in designed:
        epochs = max(needed.result(test).epochs_needed or 0, 2)
        report = run(_rows(make, epochs, seed=len(name)), labels=labels, batch_size=64, compute_power=False)
        assert report.result(test).verdict == "fail", (name, test, report.format())


def test_a_fixed_permutation_repeated_every_epoch() -> None:
    """Every epoch alone is a uniform draw; the dependence between epochs is what is wrong."""
    fixed = np.random.default_rng(8).permutation(N)
    needed = run(uniform(N, 400, 2)).result("epoch_independence").epochs_needed
    assert needed is not None
    report = run(np.tile(fixed, (needed, 1)), compute_power=False)
    assert report.result("epoch_independence").verdict == "fail"
    assert report.result("storage_spearman").verdict == "pass"  # nothing to do with storage order
    blocks = alternatives.repeated_block_orders(np.random.default_rng(3), N, B10, needed)
    assert run(blocks, compute_power=False).result("epoch_independence").verdict == "fail"


def test_all_orders_rejects_a_buffer_of_two() -> None:
    needed = run(uniform(5, 600, 3)).result("all_orders").epochs_needed
    assert needed is not None and needed >= 600
    report = run(_rows(lambda g: alternatives.buffer_shuffle(g, 5, 2), needed, seed=4), compute_power=False)
    assert report.result("all_orders").verdict == "fail"


# Weak, homogeneous departures (every epoch alike), where the power figure is not met trivially.
def _noisy_sort(rng: np.random.Generator, sigma: float) -> np.ndarray:
    return np.argsort(np.arange(N) / N + sigma * rng.standard_normal(N), kind="stable")


def _noisy_blocks(rng: np.random.Generator, sigma: float) -> np.ndarray:
    rank = rng.permutation(N // B10)[np.arange(N) // B10]
    return np.argsort(rank / (N // B10) + sigma * rng.standard_normal(N), kind="stable")


def _noisy_repeat(rng: np.random.Generator, epochs: int, sigma: float) -> np.ndarray:
    rows = [rng.permutation(N)]
    for _ in range(epochs - 1):
        rows.append(np.argsort(np.argsort(rows[-1]) / N + sigma * rng.standard_normal(N), kind="stable"))
    return np.array(rows)


WEAK: dict[str, tuple[str, Callable[[np.random.Generator, int], np.ndarray]]] = {
    "item_position": ("buffer", lambda g, e: np.array([_noisy_sort(g, 1.5) for _ in range(e)])),
    "storage_spearman": ("buffer", lambda g, e: np.array([_noisy_sort(g, 6.0) for _ in range(e)])),
    "labels_per_batch": ("buffer", lambda g, e: np.array([_noisy_sort(g, 1.5) for _ in range(e)])),
    "adjacent_pairs": ("block", lambda g, e: np.array([_noisy_blocks(g, 0.6) for _ in range(e)])),
    "joint_positions": ("block", lambda g, e: np.array([_noisy_blocks(g, 0.6) for _ in range(e)])),
    "epoch_independence": ("repeated", lambda g, e: _noisy_repeat(g, e, 3.0)),
}


@pytest.mark.parametrize("name", list(WEAK))
def test_power_figures_hold_for_weak_departures(name: str) -> None:
    """Give the battery a weak reference alternative, take its epochs-needed figure for 80% power,
    and count rejections over 60 seeded replicates at that many epochs: at least 39 (a true power of
    0.8 falls below that with probability < 1e-3), so the figure is not optimistic."""
    reference, make = WEAK[name]
    test = next(t for t in BATTERY if t.name == name)
    labels = np.arange(N) * 10 // N
    rng = np.random.default_rng(17)
    ctx = bt._Context(prepare(make(rng, 50), labels=labels), Settings(batch_size=16))
    ctx._refs[reference] = make(rng, 3000)
    needed = test.run(ctx).epochs_needed
    assert needed is not None and needed > 10  # a weak effect: power, not the approximation, decides
    rejected = sum(
        test.run(bt._Context(prepare(make(rng, needed), labels=labels),
                             Settings(batch_size=16, compute_power=False, seed=i))).verdict == "fail"
        for i in range(60))
    assert rejected >= stats.binom.ppf(1e-3, 60, 0.8), (needed, rejected)


# ---------------------------------------------------------------------------------------------- behaviour
def test_bins_adapt_to_few_epochs_and_tests_say_what_they_need() -> None:
    report = run(uniform(200, 1, 5))
    ip = report.result("item_position")
    assert ip.verdict == "pass" and ip.detail.startswith("6 item x 6 position bins")
    ei = report.result("epoch_independence")
    assert ei.verdict == "n/a" and ei.epochs_needed is not None and ei.epochs_needed > 1 and "needs >=" in ei.detail
    tiny = run(np.array([[1, 0, 2]]))
    assert not tiny.tested and all(r.verdict == "n/a" for r in tiny.results)


def test_the_storage_order_map_is_what_makes_neighbours_neighbours() -> None:
    """A block shuffle over storage, recorded as keys that are not storage positions. Without the map
    the keys of one block look unrelated, and only many epochs show that the same keys always come
    out together; with the map one epoch is enough for every storage-aware test."""
    rng = np.random.default_rng(6)
    storage_of_key = rng.permutation(N)
    key_at_storage = np.argsort(storage_of_key)
    storage_rows = np.array([alternatives.block_shuffle(rng, N, B10) for _ in range(2)])
    keys = key_at_storage[storage_rows]
    blind, seeing = run(keys, compute_power=False), run(keys, storage_order=storage_of_key, compute_power=False)
    for name in ("item_position", "adjacent_pairs", "joint_positions"):
        assert blind.result(name).verdict == "pass" and seeing.result(name).verdict == "fail", name
        assert seeing.result(name).statistic > 5 * blind.result(name).statistic  # type: ignore[operator]


def test_report_text_json_and_reproducibility() -> None:
    keys = uniform(60, 100, 7)
    labels = np.arange(60) % 6
    a, b = run(keys, labels=labels, batch_size=8, seed=3), run(keys, labels=labels, batch_size=8, seed=3)
    assert a.to_dict() == b.to_dict()
    c = run(keys, labels=labels, batch_size=8, seed=4)
    assert c.result("labels_per_batch").pvalue != a.result("labels_per_batch").pvalue  # simulated null
    assert c.result("item_position").pvalue == a.result("item_position").pvalue  # closed form
    text = a.format().splitlines()
    assert len(text) == 1 + len(BATTERY) + 1 and text[-1].startswith("PASS")
    assert any(line.startswith("item_position") and "chi2(" in line and "needs >=" in line for line in text)
    data = json.loads(a.to_json())
    assert data["passed"] is True and [t["name"] for t in data["tests"]] == [t.name for t in BATTERY]
    lab = next(t for t in data["tests"] if t["name"] == "labels_per_batch")
    assert lab["null_draws"] == 500 and lab["verdict"] == "pass" and lab["enough_epochs"] is True
    with pytest.raises(KeyError, match="no test named"):
        a.result("nope")


def test_options_are_validated_by_name() -> None:
    keys = uniform(10, 5, 0)
    with pytest.raises(ConfigError, match="labels: the labels-per-batch test also needs batch_size"):
        run(keys, labels=np.arange(10))
    with pytest.raises(ConfigError, match="alpha: expected a number strictly between 0 and 1"):
        run(keys, alpha=0)
    with pytest.raises(ConfigError, match="bins: expected a whole number >= 2"):
        run(keys, bins=1)
    with pytest.raises(ConfigError, match="seed"):
        run(keys, seed=-1)
    big = run(keys, labels=np.arange(10), batch_size=11).result("labels_per_batch")
    assert big.verdict == "n/a" and "larger than a row" in big.detail
    assert math.isclose(run(keys, alpha=0.05).alpha, 0.05)
