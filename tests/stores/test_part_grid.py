"""Parts of a cold download stay in the cells of the part grid (issue 32): about one request per
cell, not a part cut from each ask plus the leftover pieces of its cells, and every part starts and
ends on the store's chunk edges; a shard's index page joins its last cell."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import Dataset
from shardkit.readers import TieredSampler
from shardkit.stores import cache as cache_mod
from shardkit.stores import prefetch
from tests.helpers.datasets import upload
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.sampler_data import check_batch, make_dataset
from tests.helpers.small_parts import cache_dir

PART_PAGES = 32


def _fill(npages: int) -> prefetch._Fill:
    return prefetch._Fill(0, prefetch.PrefetchItem("k", "n", npages * cache_mod.PAGE_BYTES), -1, -1)


def test_a_part_never_crosses_the_part_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "PART_BYTES", PART_PAGES * cache_mod.PAGE_BYTES)
    fill = _fill(125)
    assert fill.span(3, 125) == (3, 32)  # to its cell's end, not 3 + 32
    assert fill.span(40, 125) == (40, 64)
    fill.busy[50] = 1
    assert fill.span(40, 125) == (40, 50)
    assert fill.span(100, 125) == (100, 125)  # the last cell ends with the copy
    tail = _fill(4 * PART_PAGES + 1)  # a shard's index page after its last whole cell joins that cell
    assert tail.span(3 * PART_PAGES + 5, tail.npages) == (3 * PART_PAGES + 5, tail.npages)
    assert prefetch.grid_cell(tail.npages - 1, tail.npages) == (3 * PART_PAGES, tail.npages)
    wanted = bytearray(125)
    wanted[30] = wanted[33] = 1
    assert fill.span(0, 125, bytes(wanted)) == (30, 31)  # asks stop at the grid too


def test_cold_epoch_makes_about_one_request_per_cell(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's shape, shrunk (128 KiB records, RAM a quarter of the dataset): with parts cut
    from each ask and each shard's index page a request of its own, made last, this epoch made 20
    requests for 16 cells; on the grid, the index page in the last cell, at most two more than the
    cells. Bytes: the dataset once."""
    monkeypatch.setattr(prefetch, "PART_BYTES", PART_PAGES * cache_mod.PAGE_BYTES)
    # The background at its full width from the start: the count is the grid's alone (the opening, two
    # parts until the first asks land, leaves more of a small first block to its own asks; it is
    # tested in test_cold_schedule.py).
    monkeypatch.setattr(prefetch, "OPENING_SECONDS", 0.0)
    n, per_shard = 256, 64  # 128 KiB records: shards of 128 pages and their index, four cells each
    local = make_dataset(tmp_path / "ds", n, records_per_shard=per_shard, shape=(128, 256, 4))
    url = upload(local, s3.url(f"grid-{tmp_path.name}"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        s = TieredSampler(url, cache_dir=cache_dir(tmp_path), batch_size=8, epochs=1, seed=5,
                          ram_size=f"{n // 4}records")
        assert sum(len(b["key"]) for b in s) == n
        requests = [path for path, _ in proxy.gets if "/image/c/" in path]
    finally:
        proxy.close()
    shards = sorted(p for p in (local / "image" / "c").rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in shards)
    cells = sum(p.stat().st_size // (PART_PAGES * cache_mod.PAGE_BYTES) for p in shards)  # (the index joins the last)
    assert cells == 16
    assert s.stats.disk.bytes_read == total

    assert len(requests) <= cells + 2, len(requests)


def test_a_short_piece_of_a_cell_joins_its_neighbour(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages asked for in the middle of cells leave pieces; one under a quarter part joins the
    piece of its free run in the next cell (either side), so it is no request of its own."""
    monkeypatch.setattr(prefetch, "PART_BYTES", PART_PAGES * cache_mod.PAGE_BYTES)
    fill = _fill(4 * PART_PAGES)
    fill.present[34:36] = b"\1\1"  # an ask near the start of cell 1: a short piece before it
    fill.present[92:94] = b"\1\1"  # one near the end of cell 2: a short piece after it
    assert fill.joined(*fill.span(0, fill.npages)) == (0, 34)  # cell 0 takes cell 1's short piece
    assert fill.joined(32, 34) == (0, 34)  # and the short piece, picked first, takes cell 0
    assert fill.joined(36, 64) == (36, 64)  # two long pieces stay apart (on the grid)
    assert fill.joined(64, 92) == (64, 92)  # a piece ended by asked pages: nothing to join
    assert fill.joined(94, 96) == (94, 128)  # the short piece after takes the next cell
    assert fill.joined(96, 128) == (94, 128)
    fill.busy[95] = 1
    assert fill.joined(96, 128) == (96, 128)  # the piece is no longer free: a cell alone


def test_the_first_blocks_asks_leave_no_small_requests(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first block's record in each shard, asked alone with the background held back, then the
    rest of the download: each shard makes one request per cell, the record's and its tail's (the
    index with it), and no other request under a quarter part. Before: the piece the record's
    pages left before them and each shard's index page were requests of their own."""
    monkeypatch.setattr(prefetch, "PART_BYTES", PART_PAGES * cache_mod.PAGE_BYTES)
    monkeypatch.setattr(prefetch, "hold_background", threading.Event())
    per_shard, shards = 64, 3  # 128 KiB records: 128 pages and the index a shard, four cells
    local = make_dataset(tmp_path / "ds", per_shard * shards, records_per_shard=per_shard, shape=(128, 256, 4))
    url = upload(local, s3.url(f"asks-{tmp_path.name}"))
    proxy = FaultProxy(s3.port, lambda n: "ok")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    keys = [s * per_shard + 17 for s in range(shards)]  # pages 34-35: two pages into cell 1
    try:
        with Dataset(url, cache_dir=cache_dir(tmp_path)) as ds:
            check_batch({"key": np.array(keys), **ds.read(keys)})
            prefetch.hold_background.set()
            payload: Any = ds.payload
            deadline = time.monotonic() + 30
            while any(payload._cached_fd(i) is None for i in range(shards)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(payload._cached_fd(i) is not None for i in range(shards))
        sizes = [r[1] + 1 - r[0] if r else 0 for (path, _), r in zip(proxy.gets, proxy.ranges) if "/image/c/" in path]
    finally:
        proxy.close()
    quarter = PART_PAGES // prefetch.DEMAND_GAPS_PER_PART * cache_mod.PAGE_BYTES
    assert len(sizes) == shards * (4 + 2), sizes
    assert sum(n < quarter for n in sizes) == 2 * shards, sizes
