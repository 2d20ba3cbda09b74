"""benchmarks/multinode.py: its measurement of one configuration and its model check, on small inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark


def test_one_configuration_and_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mn = load_benchmark("multinode", monkeypatch)
    from _common import synthetic_dataset

    n, rec = 512, 8 * 8 * 3
    data = synthetic_dataset(tmp_path / "data", n, (8, 8, 3))
    off = mn.run_config(data, 4, 1, 32, 1.0, False, n, rec)
    on = mn.run_config(data, 4, 1, 32, 1.0, True, n, rec)
    assert off["records"] == on["records"] == n  # 512 = 4 whole global batches of 4 x 32
    assert off["hit_rate"] == pytest.approx(0.25)  # every node pins the same quarter without locality
    assert on["hit_rate"] > 0.85
    assert on["storage_records"] == n - on["hits"] and off["storage_records"] == n - off["hits"]
    assert json.loads(json.dumps([off, on], default=mn._plain))[1]["hits"] == on["hits"]  # --json writes them
    on_reads = mn.warmup(data, 4, 32, n, 3, True)
    off_reads = mn.warmup(data, 4, 32, n, 3, False)
    assert on_reads[0] == n and off_reads[0] == n  # cold: everything from storage
    assert on_reads[2] < off_reads[2]  # locality fills its caches within a couple of epochs
    for row in mn.part2(quick=True):
        assert abs(row["measured"] - row["model"]) <= 4 * row["se"] + 1e-3
