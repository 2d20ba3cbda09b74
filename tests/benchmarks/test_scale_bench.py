"""Smoke test of benchmarks/scale.py: both workers on a small dataset of 32-byte records, so a change
of the sampler's API cannot silently break the benchmark of issue #34."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark


def test_scale_workers_deliver_every_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("scale", monkeypatch)
    n = 10_000
    path = bench.dataset(tmp_path, n)
    assert bench.dataset(tmp_path, n) == path  # cached: not written again
    tree = str(Path(__file__).resolve().parents[2])
    for worker in (bench.sampler_worker, bench.numpy_worker):
        res = worker({"kind": "", "tree": tree, "path": str(path), "seed": 1})
        assert res["records"] == n and res["wrong"] == 0  # every key's payload checked
        assert res["peak_rss"] >= res["base_rss"] > 0 and res["pss"] > 0 and res["cpu"] > 0


def test_scale_ratio_rows_hold_the_reference_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-ratio table runs a smaller dataset with the budget at which it needs as many blocks
    an epoch as the reference at 256 MiB, and the worker runs with that budget."""
    bench = load_benchmark("scale", monkeypatch)
    want = bench.blocks_per_epoch(10**8, bench.RAM)
    assert want > 10  # the reference is many passes over its dataset
    for n in (10**6, 10**7):
        ram = bench.matched_ram(n, 10**8)
        # As many as whole batches a block allow (at most as many), with the smallest such budget.
        assert ram < bench.RAM and 0.9 * want <= bench.blocks_per_epoch(n, ram) <= want
        assert bench.blocks_per_epoch(n, ram - (1 << 10)) > want
    n = 10_000
    path = bench.dataset(tmp_path, n)
    tree = str(Path(__file__).resolve().parents[2])
    cfg = {"kind": "sampler", "tree": tree, "path": str(path), "seed": 1, "ram": 1 << 20, "static_cache": "off"}
    res = bench.sampler_worker(cfg)
    assert res["records"] == n and res["wrong"] == 0
    assert res["ram_block"] < bench.sampler_worker({**cfg, "ram": bench.RAM})["ram_block"]  # the budget was used


def test_scale_memory_model_counts_the_permutation_up_to_the_exact_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte model scale.py checks the measured peaks against: 8 B a record of permutation up to
    EXACT_PERMUTATION_LIMIT records, none past it (the Feistel order)."""
    bench = load_benchmark("scale", monkeypatch)
    from shardkit.order.schedule import EXACT_PERMUTATION_LIMIT

    base = 40 * 2**20
    assert bench.model_rss(10**6, base) == base + bench.RAM * 1.15 + 8 * 10**6
    assert bench.model_rss(EXACT_PERMUTATION_LIMIT + 1, base) == base + bench.RAM * 1.15
    lines = bench.model_report({10**6: (base, base + 300 * 2**20)})
    row = next(line for line in lines if line.startswith("| 1e+06"))
    assert row.split("|")[2].strip() == f"{(base + bench.RAM * 1.15 + 8 * 10**6) / 2**20:,.0f}"
    assert any(line.startswith("| 1e+10") for line in lines)
