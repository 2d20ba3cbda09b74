"""Smoke test of benchmarks/mixing.py on tiny data, so an API change cannot silently break it. The
peers (MosaicML Streaming, LitData) live in the bench extra; where they are not installed their rows
say so."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark


def test_mixing_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("mixing", monkeypatch)
    monkeypatch.setattr(bench, "DATA", tmp_path)
    args = argparse.Namespace(n=60, epochs=1, rounds=1, order_epochs=4)
    rows = bench.throughput(args)
    assert [r["config"] for r in rows] == ["1 dataset", "2 datasets", "5 datasets", "2 datasets, weights 1:1"]
    for r in rows[:3]:  # weights equal to sizes: the same records as one dataset, read once each
        assert r["emitted_per_epoch"] == 60 * 224 * 224 * 3
        assert r["emitted_per_epoch"] <= r["read_per_epoch"] < 1.05 * r["emitted_per_epoch"]  # + shard indexes
    assert "| 5 datasets |" in bench.throughput_table(rows, args)
    assert all(r["cpu_us_per_record"] > 0 and r["cpu_spread"][0] <= r["cpu_us_per_record"] for r in rows)
    # each round's ratio is to the single dataset's run of that round (its own ratio is exactly 1),
    # and the first epoch of each fresh run is timed on its own
    assert rows[0]["round_ratios"] == rows[0]["round_cpu_ratios"] == rows[0]["round_first_ratios"] == [1.0]
    assert all(len(r["round_ratios"]) == args.rounds and r["first_epoch_records_per_s"] > 0 for r in rows)
    assert "| 5 datasets | " in bench.throughput_table(rows, args).split("first epoch vs 1 dataset")[1]
    monkeypatch.setattr(bench, "ORDER_MIXES", {"two": ([30, 10], [1, 1], 40)})
    rows = bench.orders(args)
    ours = next(r for r in rows if r["loader"] == "shardkit mix()")
    assert ours["counts_min"] == ours["counts_max"] == [20, 20] and ours["epoch_lengths"] == [40, 40]
    table = bench.orders_table(rows, args)
    assert "| two | shardkit mix() | 40 | 20, 20 (20, 20) | exact |" in table
