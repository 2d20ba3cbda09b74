"""A shared tier stack serving a mixture: exact counts per epoch, batches that carry the dataset index
and the record's own key, each job's order the mixture's blocks in its own permutation, repeats read
through the SSD tier, and jobs that name another mixture refused. Timeouts only guard against hangs."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import SamplerError
from shardkit.readers import SharedSampler, TierServer
from shardkit.readers.sources import mix
from shardkit.serve.order import blocks, job_permutation, partition
from tests.helpers.sampler_data import encode, make_dataset
from tests.helpers.threads import run_jobs


@pytest.fixture
def name() -> str:
    return f"m{os.getpid()}-{secrets.token_hex(3)}"


def _check(batch: dict[str, np.ndarray], offsets: list[int]) -> np.ndarray:
    """Payload and fields belong to (dataset, key); returns the global keys."""
    g = np.array(offsets)[batch["dataset"]] + batch["key"]
    np.testing.assert_array_equal(batch["image"], encode(g))
    np.testing.assert_array_equal(batch["label"], g * 3)
    return np.asarray(g)


def _job_epoch(plan_stream: np.ndarray, job_seed: int, epoch: int, k: int, k1: int | None) -> np.ndarray:
    parts = []
    for r, (a, b) in enumerate(blocks(plan_stream.size, k, k1)):
        stored = np.sort(plan_stream[a:b])
        parts.append(stored[job_permutation(job_seed, epoch, r, stored.size)])
    return np.concatenate(parts)


@pytest.mark.parametrize("tiers", ["ram", "ram,ssd"])
def test_a_server_serves_a_mixture(tmp_path: Path, ssd_dir: Path, name: str, tiers: str) -> None:
    """Dataset 1 (5 records) weighted so that each epoch holds it 3 times over (n = 15 > N = 5): the
    SSD reservoirs store each record once and serve its repeats."""
    a = make_dataset(tmp_path / "a", 12, records_per_shard=4)
    b = make_dataset(tmp_path / "b", 5, records_per_shard=4, first=12)
    m = mix([(a, 1), (b, 1)], epoch_size=30)
    assert m.counts == (15, 15)
    epochs = 3
    srv = TierServer(m, name=name, tiers=tiers, ram_size="8records", ssd_size="16records", ssd_dir=ssd_dir,
                     slots=2, epochs=epochs, wait_for=2, seed=5, gap_bytes=0).start()
    try:
        def run(j: int) -> list[dict[str, np.ndarray]]:
            with SharedSampler(name, job_seed=20 + j, batch_size=7, epochs=epochs, dataset=m) as s:
                assert s.mixture is not None and s.num_records == 30
                assert "dataset" in s.element_spec()
                return list(s)

        results = run_jobs(run, range(2), timeout=120)
        assert srv.wait(30)
    finally:
        srv.close()
    plan = m.plan(5)
    for j in range(2):
        keys = np.concatenate([_check(bt, [0, 12]) for bt in results[j]]).reshape(epochs, 30)
        for e in range(epochs):
            ds = (keys[e] >= 12).astype(int)
            assert np.bincount(ds).tolist() == [15, 15]
            # The server's partition of the 30 slots, read through the mixture's item table.
            pi = plan.slot_keys(e, partition(5, e, 30))
            np.testing.assert_array_equal(keys[e], _job_epoch(pi, 20 + j, e, srv.slot_records, srv.ssd_block))
    assert srv.stats.disk.records <= epochs * 30


def test_a_job_naming_another_mixture_is_refused(tmp_path: Path, name: str) -> None:
    a = make_dataset(tmp_path / "a", 6)
    b = make_dataset(tmp_path / "b", 4, first=6)
    srv = TierServer(mix([(a, 3), (b, 1)]), name=name, ram_size="4records", epochs=1).start()
    try:
        with pytest.raises(SamplerError, match=r"serves a mixture, not .* refusing to attach"):
            SharedSampler(name, dataset=mix([(a, 1), (b, 1)]))
        with pytest.raises(SamplerError, match="refusing to attach"):
            SharedSampler(name, dataset=a)
    finally:
        srv.close()


ROOT = Path(__file__).resolve().parents[2]


def test_cli_serves_a_mixture(tmp_path: Path, name: str) -> None:
    import subprocess
    import sys

    from shardkit.serve import wait_for_server

    a = make_dataset(tmp_path / "a", 6)
    b = make_dataset(tmp_path / "b", 4, first=6)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "shardkit.cli.main", "serve", str(a), str(b), "--name", name,
                          "--weights", "3,1,1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        "error: --weights: expected one weight per dataset (2), found 3: '3,1,1'")
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", "serve", str(a), str(b), "--name", name,
                          "--weights", "3,1", "--epoch-size", "8", "--ram-size", "4records", "--epochs", "1"],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        info = wait_for_server(name, timeout=60)
        assert info.mixture is not None and info.mixture.weights == ("3", "1") and info.num_records == 8
        with SharedSampler(name, job_seed=1, batch_size=3) as s:
            batches = list(s)
        g = np.concatenate([_check(bt, [0, 6]) for bt in batches])
        assert np.bincount((g >= 6).astype(int)).tolist() == [6, 2]
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert b"weight 3 (6 of 6 records per epoch)" in err
    finally:
        p.kill()
        p.communicate(timeout=30)
