"""Order tests for mixtures (shardkit.ordertest.mixture): exact nulls, power against broken mixtures, CLI.

alpha = 1e-3, fixed seeds. Each broken mixture below breaks one promise and must fail that test.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.order.mixture import MixturePlan
from shardkit.ordertest.mixture import arrangement_table_test, equal_neighbours_moments, run_mixture
from tests.helpers.order_stats import ALPHA
from tests.ordertest.test_cli import cli

SIZES = (60, 20)


def _ours(epochs: int, seed: int = 1) -> np.ndarray:
    plan = MixturePlan.create(SIZES, [3, 1], seed=seed)
    return np.stack([plan.pairs(e) for e in range(epochs)])


def _iid_source(epochs: int, seed: int = 0, walks: bool = True) -> np.ndarray:
    """tf.data / LitData style: every slot's dataset drawn at random (weights 3:1); each dataset read
    through reshuffled passes (walks=True) or as an independent uniform draw per slot."""
    g = np.random.default_rng(seed)
    left: list[list[int]] = [[], []]
    rows = []
    for _ in range(epochs):
        row = []
        for d in (g.random(sum(SIZES)) < 0.25).astype(int):
            if walks:
                if not left[d]:
                    left[d] = list(g.permutation(SIZES[d]))
                row.append((d, left[d].pop()))
            else:
                row.append((d, int(g.integers(SIZES[d]))))
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def test_equal_neighbours_moments_are_exact() -> None:
    for counts in [(2, 1), (3, 2), (2, 2, 1), (4, 1, 2), (3, 3), (1, 4), (2, 2, 2)]:
        items = [i for i, c in enumerate(counts) for _ in range(c)]
        values = [sum(a == b for a, b in itertools.pairwise(p)) for p in set(itertools.permutations(items))]
        mean, var = equal_neighbours_moments(np.array(counts))
        assert mean == pytest.approx(np.mean(values)) and var == pytest.approx(np.var(values))


def test_table_null_is_calibrated_when_counts_drift() -> None:
    """Uniform arrangements whose counts change every epoch (iid slot sources are uniform given the
    counts): the p-values of the exact-covariance statistic are uniform (KS test over 300 runs)."""
    g = np.random.default_rng(5)
    length, epochs, bins = 24, 40, 4
    pvals = []
    for _ in range(300):
        ds = (g.random((epochs, length)) < 0.3).astype(int)
        counts = np.stack([np.bincount(r, minlength=2) for r in ds])
        pos = np.arange(length) * bins // length
        table = np.zeros((2, bins))
        np.add.at(table, (ds, np.broadcast_to(pos, ds.shape)), 1)
        h = np.broadcast_to(np.bincount(pos), (epochs, bins))
        x2, weights, _ = arrangement_table_test(table, counts, h, length)
        from shardkit.ordertest.stats import weighted_chi2_sf

        pvals.append(weighted_chi2_sf(x2, weights))
    assert stats.kstest(pvals, "uniform").pvalue > ALPHA


def test_our_mixture_passes_everything() -> None:
    report = run_mixture(_ours(300), sizes=SIZES, weights=[3, 1], compute_power=False)
    assert report.passed, report.format()
    assert {r.name: r.verdict for r in report.results} == dict.fromkeys(
        ["counts", "slot_positions", "slot_runs", "slot_independence", "walk_balance"], "pass"
    )
    assert all(d is not None and d.result("item_position").verdict == "pass" for d in report.datasets)
    assert report.counts.min(axis=0).tolist() == [60, 20] == report.counts.max(axis=0).tolist()


def test_random_source_per_slot_fails_the_counts() -> None:
    report = run_mixture(_iid_source(300), sizes=SIZES, weights=[3, 1], compute_power=False)
    assert report.result("counts").verdict == "fail"
    assert report.result("slot_positions").verdict == "pass"  # uniform given its counts
    assert not report.passed and "counts" in report.format().splitlines()[-1]


def test_draws_with_replacement_fail_the_walk_balance() -> None:
    report = run_mixture(_iid_source(50, walks=False), sizes=SIZES, compute_power=False)
    assert report.result("walk_balance").verdict == "fail"


def test_interleaving_patterns_fail_the_slot_tests() -> None:
    ours = _ours(300)
    # Round robin (A A A B ...): every slot's dataset is fixed.
    pattern = ours.copy()
    for e in range(pattern.shape[0]):
        order = np.argsort(pattern[e, :, 0], kind="stable")
        a, b = order[:60], order[60:]
        slots = np.empty(80, dtype=np.int64)
        slots[np.arange(80) % 4 != 3], slots[np.arange(80) % 4 == 3] = a, b
        pattern[e] = pattern[e][slots]
    report = run_mixture(pattern, sizes=SIZES, weights=[3, 1], compute_power=False)
    assert report.result("slot_runs").verdict == "fail"
    # One arrangement of dataset indices reused every epoch.
    same = ours.copy()
    same[:, :, 0] = ours[0, :, 0]
    for e in range(same.shape[0]):
        for d in (0, 1):
            same[e, same[e, :, 0] == d, 1] = ours[e, ours[e, :, 0] == d, 1]
    report = run_mixture(same, sizes=SIZES, weights=[3, 1], compute_power=False)
    assert report.result("slot_positions").verdict == "fail"
    assert report.result("slot_independence").verdict == "fail"


def test_input_checks(tmp_path: Path) -> None:
    from shardkit.errors import ConfigError, InputFileError

    with pytest.raises(InputFileError, match=r"\[epochs, L, 2\]"):
        run_mixture(np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(InputFileError, match=r"dataset 1: key 20 is outside 0\.\.19"):
        bad = _ours(2)
        bad[0, bad[0, :, 0] == 1, 1] = 20
        run_mixture(bad, sizes=SIZES)
    with pytest.raises(ConfigError, match="one weight per dataset"):
        run_mixture(_ours(2), weights=[1])
    cut = _ours(3)
    cut[2, 40:] = -1
    report = run_mixture(cut, sizes=SIZES, compute_power=False)
    assert report.epochs == 2 and any("cut short" in n for n in report.notes)


def test_cli_takes_a_mixture_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "mix.npy", tmp_path / "iid.npy"
    np.save(good, _ours(200))
    np.save(bad, _iid_source(200))
    code, out, _ = cli(capsys, str(good), "--sizes", "60,20", "--weights", "3,1")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"{good}: 200 epoch(s) x 80 slots from 2 datasets of 60, 20 records")
    assert any(line.startswith("counts ") and "PASS" in line for line in lines)
    assert any(line.startswith("-- dataset 1: ") for line in lines) and lines[-1].startswith("PASS")
    code, out, _ = cli(capsys, str(bad), "--weights", "3,1", "--json")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False
    assert next(t for t in data["tests"] if t["name"] == "counts")["verdict"] == "fail"
    code, _, err = cli(capsys, str(good), "--labels", str(good))
    assert code == 2 and "--labels: not available for a mixture" in err
    flat = tmp_path / "flat.npy"
    np.save(flat, np.array([np.random.default_rng(0).permutation(10) for _ in range(5)]))
    code, _, err = cli(capsys, str(flat), "--weights", "3,1")
    assert code == 2 and "--sizes and --weights describe a mixture" in err
    code, _, err = cli(capsys, str(good), "--weights", "3,x")
    assert code == 2 and "--weights: weight 1 must be a finite number > 0" in err
