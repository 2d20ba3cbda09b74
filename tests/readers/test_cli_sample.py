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
