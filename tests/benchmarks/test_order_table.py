"""``benchmarks/order_table.py``: the battery over the orders ``compare.py`` records, as a Markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from shardkit.ordertest import alternatives
from tests.helpers.benchmarks import load_benchmark


@pytest.fixture
def order_table(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("order_table", monkeypatch)


def test_table_from_recorded_orders(tmp_path: Path, order_table: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The layout compare.py writes: <loader>.npy [epochs, N], labels.npy, meta.json."""
    rng = np.random.default_rng(1)
    n = 200
    np.save(tmp_path / "sampler-ram.npy", np.array([rng.permutation(n) for _ in range(100)]))
    np.save(tmp_path / "wds.npy", np.array([alternatives.buffer_shuffle(rng, n, 67) for _ in range(100)]))
    np.save(tmp_path / "labels.npy", np.arange(n) * 10 // n)
    (tmp_path / "meta.json").write_text(json.dumps({
        "records": n, "epochs": 100, "batch": 64,
        "loaders": {"sampler-ram": "shardkit TieredSampler", "wds": "WebDataset", "mds": "not recorded"}}))
    png = tmp_path / "wds.png"
    assert order_table.main([str(tmp_path), "--plot", "wds", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| loader | epochs x N | item_position |") and len(lines) == 4
    assert lines[2].startswith("| shardkit TieredSampler | 100 x 200 |") and lines[2].endswith("| yes |")
    assert lines[3].startswith("| WebDataset |") and "**< 1e-300**" in lines[3] and "**no** (item_position" in lines[3]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert order_table.main([str(tmp_path / "none")]) == 2
