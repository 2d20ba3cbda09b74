"""The order a shared tier stack gives its jobs: uniform with the defaults, and what sharing costs.

alpha = 1e-3, fixed seeds. The default-configuration test fails on the code before the random
domains (server seed 0 and job seed 0 drew the partition and reservoir 0's permutation from one
stream: item x position p ~ 1e-67 with these sizes).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.readers import SharedSampler, TierServer
from shardkit.serve import wait_for_server
from shardkit.serve.order import job_order, job_permutation, partition
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import check_batch, make_dataset
from tests.helpers.threads import run_jobs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def name() -> str:
    return f"ord{os.getpid()}-{secrets.token_hex(4)}"


def test_default_configuration_is_uniform(tmp_path: Path, name: str) -> None:
    """``shardkit serve`` with its defaults (seed 0, 3 slots) and a job with seed 0 and the default
    batch size (the adapters' default seed): only the ring is small (K = 4 of N = 8, two reservoirs)
    so an epoch has several reservoirs. Item x position chi-square, scaled, (N-1)^2 dof."""
    n, epochs = 8, 2000
    ds = make_dataset(tmp_path / "ds", n)
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(ds), "--name", name,
                          "--ram-size", "12records", "--epochs", str(epochs)], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        info = wait_for_server(name, timeout=60)
        assert (info.seed, info.slots, info.slot_records) == (0, 3, 4)
        job = SharedSampler(name, job_seed=0, epochs=epochs)
        orders = np.concatenate([check_batch(b) for b in job]).reshape(epochs, n)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode(errors="replace")
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
    assert (np.sort(orders, axis=1) == np.arange(n)).all()
    for e in (0, 1, epochs - 1):
        np.testing.assert_array_equal(orders[e], job_order(0, 0, e, n, 4))
    assert item_position_pvalue(orders) > ALPHA


def test_seeds_beyond_32_bits_do_not_alias_epochs() -> None:
    """``(seed 5 + 3 * 2**32, epoch 0)`` and ``(seed 5, epoch 3)`` once drew the same partition."""
    assert not np.array_equal(partition(5 + 3 * 2**32, 0, 50), partition(5, 3, 50))
    assert not np.array_equal(job_permutation(5 + 3 * 2**32, 0, 0, 50), job_permutation(5, 3, 0, 50))
    assert not np.array_equal(job_permutation(0, 0, 0, 50), partition(0, 0, 50))  # the default seeds


def _spearman_sd(n: int, k: int) -> float:
    """Exact standard deviation of one epoch's Spearman correlation between two jobs (``k | n``).

    Positions are ``r*K + a`` and ``r*K + b`` with ``a``, ``b`` independent uniform permutations
    inside each of the ``R = N/K`` reservoirs, so ``rho_e = (K * sum_r c_r^2 + sum_r sum_j a_j b_j) / S``
    with ``S = N (N^2 - 1) / 12``; the second sum has variance ``R * (K (K^2 - 1) / 12)^2 / (K - 1)``.
    """
    r = n // k
    return math.sqrt(r * (k * (k * k - 1) / 12) ** 2 / (k - 1)) / (n * (n * n - 1) / 12)


def test_two_jobs_orders_are_correlated_as_documented(tmp_path: Path, name: str) -> None:
    """Two jobs on one server: each order uniform, but an item's positions in the two jobs have
    Spearman correlation (N^2 - K^2) / (N^2 - 1) (README, "what sharing costs"); measured here
    through the real server and compared with that value (z-test on the per-epoch mean)."""
    n, k, epochs = 16, 4, 400
    ds = make_dataset(tmp_path / "ds", n)
    with TierServer(ds, name=name, ram_size="12records", epochs=epochs, wait_for=2, seed=11) as srv:
        assert srv.slot_records == k

        def run(seed: int) -> np.ndarray:
            s = SharedSampler(name, job_seed=seed, batch_size=n, epochs=epochs)
            return np.concatenate([check_batch(b) for b in s]).reshape(epochs, n)

        results = run_jobs(run, (1, 2), timeout=300)
        assert srv.wait(60)
    pos = {seed: np.argsort(o, axis=1) for seed, o in results.items()}  # pos[e, item]
    for seed in (1, 2):
        assert item_position_pvalue(results[seed]) > ALPHA  # each job alone: uniform
    rho = np.array([stats.spearmanr(pos[1][e], pos[2][e]).statistic for e in range(epochs)])
    expected = (n * n - k * k) / (n * n - 1)
    z = (rho.mean() - expected) / (_spearman_sd(n, k) / math.sqrt(epochs))
    assert 2 * stats.norm.sf(abs(z)) > ALPHA, (rho.mean(), expected)
    assert all(np.abs(pos[1][e] - pos[2][e]).max() < k for e in range(epochs))  # same reservoir, same block
