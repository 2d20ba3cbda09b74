"""``shardkit order-test`` on what loaders really emit: ``shardkit sample --order-out`` (every shape it
writes) after a real conversion, and a peer loader's keys as ``benchmarks/compare.py`` records them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.cli.main import main
from shardkit.formats import open_dataset
from shardkit.ordertest import run
from tests.helpers.benchmarks import load_benchmark
from tests.helpers.datasets import DATASETS
from tests.helpers.sampler_data import make_dataset


def shardkit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=300)


def in_process(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_convert_sample_order_test(tmp_path: Path) -> None:
    """The real chain, as a user types it: convert the bundled image folders, sample 400 epochs,
    record the order, test it with the dataset's labels. Exit code 0, every applicable test passes."""
    ds, keys, labels = tmp_path / "ds", tmp_path / "keys.npy", tmp_path / "labels.npy"
    res = shardkit("convert", str(DATASETS / "imagefolder"), "-o", str(ds), "--size", "8", "-j", "1")
    assert res.returncode == 0, res.stderr
    res = shardkit("sample", str(ds), "--epochs", "400", "--batch-size", "4", "--seed", "5", "--order-out", str(keys))
    assert res.returncode == 0, res.stderr
    with open_dataset(ds) as d:
        np.save(labels, np.asarray(d.fields["label"]))
        n = d.num_records
    res = shardkit("order-test", str(keys), "--labels", str(labels), "--batch-size", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0].startswith(f"{keys}: 400 epoch(s) x {n} keys, N = {n} records, a permutation")
    report = run(keys, labels=labels, batch_size=4)
    assert report.passed and {r.name for r in report.tested} >= {
        "item_position", "adjacent_pairs", "joint_positions", "storage_spearman", "labels_per_batch",
        "epoch_independence"}


def test_every_order_out_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank's slice (distinct keys), replacement mode (one flat row with repeats) and a run cut
    short by --limit (-1 padding) are each recognised and tested with what applies."""
    ds = make_dataset(tmp_path / "ds", 40, records_per_shard=8)
    rank = tmp_path / "rank.npy"
    assert in_process("sample", str(ds), "--epochs", "300", "--batch-size", "4", "--world-size", "2", "--rank", "1",
                      "--seed", "1", "--order-out", str(rank)) == 0
    report = run(rank, records=40)
    assert report.kind == "distinct" and report.length == 20 and report.passed, report.format()
    assert "inclusion_frequency" in {r.name for r in report.tested}

    repl = tmp_path / "repl.npy"
    assert in_process("sample", str(ds), "--mode", "replacement", "--ram-size", "8records", "--epochs", "50",
                      "--batch-size", "4", "--order-out", str(repl)) == 0
    report = run(repl, records=40)
    assert report.kind == "repeats" and report.epochs == 1 and report.passed, report.format()
    assert {r.name for r in report.tested} == {"inclusion_frequency", "storage_spearman"}

    cut = tmp_path / "cut.npy"
    assert in_process("sample", str(ds), "--epochs", "200", "--batch-size", "4", "--limit", str(40 * 150 + 10),
                      "--order-out", str(cut)) == 0
    assert (np.load(cut)[-1] == -1).any()
    capsys.readouterr()
    assert in_process("order-test", str(cut)) == 0
    out = capsys.readouterr().out
    assert "150 epoch(s) x 40 keys" in out and "note: dropped 1 row(s) cut short" in out


def test_a_peer_loaders_recorded_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys ``benchmarks/compare.py`` records for a peer (a PyTorch DataLoader shuffling a
    per-file dataset; its child saves ``[epochs, N]`` int64) go straight into the tool."""
    pytest.importorskip("torch")
    cl = load_benchmark("_compare_loaders", monkeypatch)
    labels = tmp_path / "labels.npy"
    np.save(labels, np.arange(60) * 6 // 60)
    cfg = cl.RunConfig(loader="perfile", n=60, shape=[1], batch=8, workers=0, epochs=120, seed=3,
                       paths={}, labels_file=str(labels), decode=False)
    result = tmp_path / "perfile.result"
    cl.run_child(cfg, result)
    keys = result.with_suffix(".npy")
    assert np.load(keys).shape == (120, 60) and np.load(keys).dtype == np.int64
    assert in_process("order-test", str(keys), "--labels", str(labels), "--batch-size", "8") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS")
