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
