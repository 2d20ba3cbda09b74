"""Staged blocks (issue 34): small records without a static cache are read block by block into one
staging buffer in ascending key order, and each batch is taken from it by rank. The batches are
the unstaged plan's, record for record, in every order; the read is one consecutive destination."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import DatasetWriter, FieldSpec
from shardkit.formats.reader import Destination, PayloadArray
from shardkit.order import schedule
from shardkit.readers import TieredSampler, options
from shardkit.tiers.pipeline import ranked

#: Records of 8 bytes (record ``i`` holds ``i``), several shards; a budget of a few batches a block.
N, REC, BATCH = 3000, 8, 16
RAM = 8 * BATCH * REC + 2 * 4 * BATCH * (REC + schedule.BLOCK_RECORD_BYTES)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("staged") / "ds"
    with DatasetWriter(path, kind="test", payload="x", record=FieldSpec((REC,), "uint8"), fields={},
                       records_per_shard=700) as w:  # fmt: skip
        w.write({"x": np.arange(N, dtype="<i8").view(np.uint8).reshape(-1, REC)})
    return path


def _run(path: Path, **kw: Any) -> tuple[bool, list[np.ndarray]]:
    """Whether the plan is staged, and every batch's keys (each row checked against its key)."""
    s = TieredSampler(path, batch_size=BATCH, ram_size=RAM, static_cache=0, seed=11, **kw)
    try:
        keys = []
        for b in s:
            np.testing.assert_array_equal(b["x"].copy().view("<i8").reshape(-1), b["key"])
            keys.append(b["key"].copy())
        return s.memory_plan.staged, keys
    finally:
        s.close()


ORDERS = {
    "exact": dict(epochs=2),
    "feistel": dict(epochs=2, permutation="feistel"),
    "replacement": dict(epochs=2, mode="replacement"),
    "ssd": dict(epochs=2, tiers="ram,ssd", ssd_size="2000records"),  # blocks start inside batches
    "limit": dict(epochs=1, limit=1000),  # the plan cut short inside a block
}


@pytest.mark.parametrize("name", list(ORDERS))
def test_staged_blocks_give_the_unstaged_batches(small: Path, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                 name: str) -> None:
    kw: dict[str, Any] = dict(ORDERS[name], ssd_dir=ssd_dir)
    staged, got = _run(small, **kw)
    assert staged
    monkeypatch.setattr(options, "STAGE_MIN_BATCHES", 1 << 40)  # the plan that reads into batch buffers
    plain, want = _run(small, **kw)
    assert not plain
    assert len(got) == len(want) > 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_staged_block_is_one_ascending_read_into_consecutive_rows(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block is one request of distinct ascending keys into consecutive rows of one buffer (no
    scatter into the block's batch buffers), and the reader does not sort it again."""
    seen: list[tuple[int, bool, int]] = []
    real = PayloadArray.read_into

    def spy(self: PayloadArray, keys: np.ndarray, dest: Destination) -> None:
        keys = np.asarray(keys)
        seen.append((len(dest.buffers), bool(np.all(np.diff(keys) > 0)), int(keys.size)))
        real(self, keys, dest)

    unsorted: list[bool] = []  # per request: did the reader take the keys as they are (no sort)?
    real_distinct = PayloadArray.read_distinct

    def distinct_spy(self: PayloadArray, distinct: np.ndarray, first: np.ndarray | None, *args: Any) -> None:
        unsorted.append(first is None)
        real_distinct(self, distinct, first, *args)

    monkeypatch.setattr(PayloadArray, "read_into", spy)
    monkeypatch.setattr(PayloadArray, "read_distinct", distinct_spy)
    staged, batches = _run(small, epochs=1)
    assert staged and len(batches) * BATCH >= N
    assert len(seen) > 2 and all(n_buf == 1 and ascending for n_buf, ascending, _ in seen)
    assert sum(size for *_, size in seen) == N  # an exact epoch: no key twice in a block
    assert len(unsorted) == len(seen) and all(unsorted)


def test_ranks_find_every_key_in_the_distinct_keys() -> None:
    """Duplicates (which the orders above never put in one block) share their distinct key's rank."""
    rng = np.random.default_rng(4)
    for keys in (rng.permutation(5000), rng.integers(0, 300, size=5000), np.array([7]), np.arange(10)[::-1].copy()):
        keys = keys.astype(np.int64)
        distinct, rank = ranked(keys, 5000)
        np.testing.assert_array_equal(distinct, np.unique(keys))
        np.testing.assert_array_equal(distinct[rank], keys)


def test_a_staged_plan_fits_the_ram_budget() -> None:
    """Two staging blocks, the batches in flight and the blocks' bookkeeping within ``ram_size``;
    the plan's lines name the staging buffers."""
    for rec, n in ((8, 10**9), (32, 10**8), (1024, 10**6)):
        sizes = options.SamplerOptions(ram_size=256 << 20, batch_size=4096, static_cache=0).tier_sizes(rec, n)
        assert sizes.staged and sizes.pool_batches == options.STAGE_POOL_BATCHES
        assert sizes.pool_bytes == sizes.pool_batches * 4096 * rec + 2 * sizes.ram_block * rec
        assert sizes.pool_bytes + 2 * sizes.ram_block * schedule.STAGED_RECORD_BYTES <= sizes.ram_bytes
        assert any("2 staging blocks" in line for line in sizes.describe())
    # Image-sized records are read straight into their batch rows (a staging copy would only add one).
    assert not options.SamplerOptions(ram_size=256 << 20, batch_size=16, static_cache=0).tier_sizes(150_528, 10**5).staged


def test_blocks_that_span_the_dataset_jump_to_the_largest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of small records spans the whole dataset after a few batches (``span_block``): the
    next block is the largest, not a doubling ramp of blocks that each read every byte again."""
    n, batch = 40_000, 64
    path = tmp_path / "ds"
    with DatasetWriter(path, kind="test", payload="x", record=FieldSpec((REC,), "uint8"), fields={},
                       records_per_shard=1 << 14) as w:  # fmt: skip
        w.write({"x": np.arange(n, dtype="<i8").view(np.uint8).reshape(-1, REC)})
    sizes: list[int] = []
    real = PayloadArray.read_into

    def spy(self: PayloadArray, keys: np.ndarray, dest: Destination) -> None:
        sizes.append(int(np.asarray(keys).size))
        real(self, keys, dest)

    monkeypatch.setattr(PayloadArray, "read_into", spy)
    ram = options.STAGE_POOL_BATCHES * batch * REC + 2 * 400 * batch * (REC + schedule.STAGED_RECORD_BYTES)
    s = TieredSampler(path, batch_size=batch, ram_size=ram, static_cache=0, seed=3, epochs=1)
    try:
        plan = s.memory_plan
        assert plan.staged and plan.span_block == schedule.span_block(n, REC, s.options.gap_bytes)
        first, largest = s.block_schedule
        assert plan.span_block is not None and plan.span_block <= first and 2 * first < largest
        keys = np.concatenate([b["key"].copy() for b in s])
    finally:
        s.close()
    np.testing.assert_array_equal(np.sort(keys), np.arange(n))
    assert sizes == [b - a for a, b in schedule.block_bounds(0, n, first, largest, plan.span_block)]
    assert sizes[:2] == [first, largest]


def test_block_bounds_jump_after_a_block_that_spans_the_dataset() -> None:
    assert list(schedule.block_bounds(0, 100, 2, 32, span=4)) == [(0, 2), (2, 6), (6, 38), (38, 70), (70, 100)]
    assert list(schedule.block_bounds(0, 20, 2, 32)) == [(0, 2), (2, 6), (6, 14), (14, 20)]
    # 32-byte records, 64 KiB gaps: from 2^14 records of 10^7 a block's mean gap is under 32 KiB
    span = schedule.span_block(10**7, 32, 1 << 16)
    assert 8192 < span <= 16384 and (10**7 / span - 1) * 32 <= (1 << 15)
