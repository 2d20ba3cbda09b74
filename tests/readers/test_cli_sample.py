"""``shardkit sample`` end to end (through main(), as a user runs it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.cli.main import main
from shardkit.readers import epoch_permutation, epoch_stream
from tests.readers.conftest import make_dataset


def _run(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


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
    assert "disk/epoch   0: " in out and "1: 0 B, 2: 0 B" in out
    assert _run(["sample", str(ds), "--ram-size", "20records", "--batch-size", "4", "--static-cache", "0"]) == 0
    assert "cache        0 records (0 B, 0.0% of the dataset)" in capsys.readouterr().out
    assert _run(["sample", str(ds), "--permutation", "random"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --permutation: ")
