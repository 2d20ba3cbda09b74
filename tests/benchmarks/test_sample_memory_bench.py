"""Smoke tests of benchmarks/sample.py and benchmarks/memory.py: one configuration on a tiny dataset,
so a change of the sampler's API cannot silently break the benchmarks the lead runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.benchmarks import load_benchmark


def test_sample_worker_measures_every_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("sample", monkeypatch)
    from shardkit.order import schedule

    # worker() sets the block constants for its (normally fresh) process: restore them for later tests
    monkeypatch.setattr(schedule, "MIN_BLOCK_BYTES", schedule.MIN_BLOCK_BYTES)
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", schedule.FIRST_BLOCK_BYTES)
    n = 40
    path = bench.synthetic_dataset(tmp_path / "ds", n)
    res = bench.worker({"path": str(path), "records": n, "batch": 8, "epochs": 2, "cold": False,
                        "ram": n * bench.REC})  # fmt: skip
    assert [e["records"] for e in res["epochs"]] == [n, n]
    assert res["epochs"][0]["disk"] >= n * bench.REC and res["epochs"][1]["disk"] == 0  # the budget caches it all
    assert res["peak_rss"] >= res["base_rss"] > 0 and res["plan"][-1] == n
    assert res["fresh"] >= 0 and bench.first_touch_cpu(1 << 20) >= 0  # the run's first-touch probe is reported
    forced = bench.worker({"path": str(path), "records": n, "batch": 8, "epochs": 1, "cold": True, "block": 16})
    assert forced["plan"][:2] == [16, 16] and forced["plan"][2] == 0  # blocks of 16 records, no cache
    raw = bench.scan(path, cold=False)
    assert raw["mbps"] > 0 and raw["cpu_per_gb"] >= 0


def test_memory_dataset_has_coco_size_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("memory", monkeypatch)
    path = bench.coco_like(tmp_path / "coco", 70)
    from shardkit.formats import open_dataset

    with open_dataset(path) as ds:
        fields = ds.fields
    assert fields["boxes"].shape == (70, bench.MAX_BOXES, 4) and bench.FIELD_BYTES > 2000
    assert np.array_equal(fields["label"], np.arange(70) % 80)
    assert bench._field_pss(1 << 22) == 0  # no such process: nothing mapped
