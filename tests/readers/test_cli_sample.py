"""``shardkit sample`` end to end (through main(), as a user runs it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.readers import epoch_permutation, epoch_stream
from tests.helpers.cli import run_main
from tests.helpers.sampler_data import make_dataset


def _run(args: list[str]) -> int:
    return run_main(*args)


def test_sample_order_out(tmp_path: Path, ssd_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = make_dataset(tmp_path / "ds", 25)
    out = tmp_path / "order.npy"
    code = _run(["sample", str(ds), "--tiers", "ssd,ram", "--ram-size", "4records", "--ssd-size", "10records",
                 "--ssd-dir", str(ssd_dir), "--batch-size", "4", "--epochs", "2", "--seed", "3",
                 "--rank", "1", "--world-size", "2", "--order-out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "records/s" in text and "MiB/s" in text and "stall" in text and "ssd" in text
    order = np.load(out)
    assert order.dtype == np.int64 and order.shape == (2, 12)  # 25 = 3 * 8 + 1: the tail goes to rank 0
    for e in range(2):
        pi = epoch_permutation(3, e, 25)
        np.testing.assert_array_equal(order[e], np.concatenate([pi[4:8], pi[12:16], pi[20:24]]))
    assert list(ssd_dir.iterdir()) == []


def test_sample_replacement_flat(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 10)
    out = tmp_path / "o.npy"
    assert _run(["sample", str(ds), "--mode", "replacement", "--ram-size", "8records", "--batch-size", "3",
                 "--epochs", "2", "--order-out", str(out)]) == 0
    order = np.load(out)
    assert order.shape == (1, 20)
    np.testing.assert_array_equal(order[0, :10], epoch_stream("replacement", 0, 0, 10, 4))


@pytest.mark.parametrize(
    "args",
    [["--tiers", "ram,tape"], ["--ram-size", "huge"], ["--mode", "shuffle"], ["--batch-size", "0"],
     ["--rank", "3", "--world-size", "2"], ["--order-out", "x.txt"]],
)
def test_sample_bad_options(tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    ds = make_dataset(tmp_path / "ds", 5)
    assert _run(["sample", str(ds), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_sample_prints_the_memory_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The block schedule, the buffers, the cache fraction and the disk bytes of every epoch."""
    ds = make_dataset(tmp_path / "ds", 20)
    assert _run(["sample", str(ds), "--ram-size", "20records", "--batch-size", "4", "--epochs", "3",
                 "--gap-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "blocks       " in out and "records first, doubling to" in out
    assert "cache        20 records (320 B, 100.0% of the dataset): every epoch after the first reads nothing" in out
    assert "disk/epoch   0: " in out and "1: 0 B in 0 calls, 2: 0 B in 0 calls" in out
    assert _run(["sample", str(ds), "--ram-size", "20records", "--batch-size", "4", "--static-cache", "0"]) == 0
    assert "cache        0 records (0 B, 0.0% of the dataset)" in capsys.readouterr().out
    assert _run(["sample", str(ds), "--permutation", "random"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --permutation: ")


def test_sample_a_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``shardkit sample A B --weights 3,1 --epoch-size L --order-out``: [epochs, L, 2] (dataset index,
    record key), the mixture's order; the summary states each dataset's share; order-test passes it."""
    import shardkit

    a = make_dataset(tmp_path / "a", 30)
    b = make_dataset(tmp_path / "b", 10, first=30)
    out = tmp_path / "mix.npy"
    assert _run(["sample", str(a), str(b), "--weights", "3,1", "--epoch-size", "50", "--batch-size", "8",
                 "--epochs", "3", "--seed", "4", "--order-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixture      50 records per epoch from 2 datasets" in text
    assert f"dataset 1   {b}: weight 1, 12 of its 10 records per epoch" in text
    order = np.load(out)
    assert order.dtype == np.int64 and order.shape == (3, 50, 2)
    plan = shardkit.mix([(a, 3), (b, 1)], epoch_size=50).plan(4)
    for e in range(3):
        np.testing.assert_array_equal(order[e], plan.pairs(e))
    assert _run(["order-test", str(out), "--weights", "3,1", "--sizes", "30,10"]) in (0, 1)
    assert "counts             PASS" in capsys.readouterr().out
    # Several datasets without --weights: weights = sizes, every record once per epoch.
    assert _run(["sample", str(a), str(b), "--batch-size", "8", "--order-out", str(out)]) == 0
    order = np.load(out)
    assert order.shape == (1, 40, 2) and np.bincount(order[0, :, 0]).tolist() == [30, 10]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--weights", "3,1,1"], "error: --weights: expected one weight per dataset (2), found 3: '3,1,1'"),
        (["--weights", "3,x"], "error: --weights: weight 1 must be a finite number > 0"),
        (["--epoch-size", "0"], "error: --epoch-size: expected a whole number >= 1"),
        (["--mode", "sequential"], "error: --mode: a mixture is sampled in 'epoch' mode"),
    ],
)
def test_sample_mixture_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    a = make_dataset(tmp_path / "a", 6)
    b = make_dataset(tmp_path / "b", 4)
    assert _run(["sample", str(a), str(b), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message) and len(err) == 1


def test_sample_refuses_a_schema_mismatch_before_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_dataset(tmp_path / "a", 6)
    b = make_dataset(tmp_path / "b", 6, shape=(4, 4, 2))
    for shard in (b / "image").rglob("*"):
        if shard.is_file() and shard.name != "zarr.json":
            shard.unlink()  # reading any payload of b would fail differently
    assert _run(["sample", str(a), str(b), "--weights", "1,1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {b}: image record shape differs from the mixture's first dataset {a}: expected (4, 4, 1), "
                   f"found (4, 4, 2); every dataset of a mixture needs the same record schema"]
