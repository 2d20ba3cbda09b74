"""The block schedule and the budget split (issue 24): growing blocks, the spare budget as a cache.

Any partition of ``pi`` into consecutive blocks gives the same order, so these tests check that
every schedule the budget rules produce (a tiny budget, growing blocks with a partial cache, the
whole dataset cached, with and without the SSD tier) emits exactly ``pi`` and an exactly uniform
order; that the first block is small and blocks grow; that storage bytes per epoch drop by exactly
the cached fraction (to 0 when the budget covers the dataset); and that resume across a change of
world size still continues the same order with another schedule.

Statistical tests use alpha = 1e-3 and fixed seeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import PayloadArray
from shardkit.formats.reader import Destination
from shardkit.order import schedule
from shardkit.order.schedule import block_bounds, read_efficiency
from shardkit.readers import TieredSampler, epoch_permutation
from shardkit.readers.options import MIN_COPY_BYTES
from shardkit.tiers.mapped import MappedShards
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import check_batch, collect, make_dataset, opening_nbytes

SHAPE = (16, 16, 4)  # 1 KiB records
REC = 1024


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block rules scaled to KiB-sized records: a 2-record first block, blocks of at least 8."""
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 2 * REC)
    monkeypatch.setattr(schedule, "MIN_BLOCK_BYTES", 8 * REC)


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Records asked for by every read pass of the dataset (the bottom tier), in order: read into
    buffers, or made resident in its mapped files when the static cache holds it whole."""
    seen: list[int] = []
    real = PayloadArray.read_into
    real_populate = MappedShards.populate

    def counted(self: PayloadArray, keys: np.ndarray, dest: Destination) -> None:
        if self.path.parent.name == "ds":
            seen.append(int(np.asarray(keys).size))
        real(self, keys, dest)

    def populated(self: MappedShards, keys: np.ndarray, *args: Any, **kw: Any) -> None:
        seen.append(int(np.asarray(keys).size))
        real_populate(self, keys, *args, **kw)

    monkeypatch.setattr(PayloadArray, "read_into", counted)
    monkeypatch.setattr(MappedShards, "populate", populated)
    yield seen


def _ds(tmp_path: Path, n: int) -> Path:
    return make_dataset(tmp_path / "ds", n, records_per_shard=5, shape=SHAPE)


# (tiers, ram_size, ssd_size) for N = 12 records of batch 1; the budgets with a cache also pay their
# two blocks' bookkeeping (4 and 3 records, BLOCK_RECORD_BYTES a record) so that records are left to cache
SCHEDULES = {
    "tiny": dict(tiers="ram", ram_size="2records"),
    "growing+cache": dict(tiers="ram", ram_size=11 * REC + 2 * 4 * schedule.BLOCK_RECORD_BYTES),
    "all-cached": dict(tiers="ram", ram_size="12records"),
    "ssd+cache": dict(tiers="ram,ssd", ram_size=11 * REC + 2 * 3 * schedule.BLOCK_RECORD_BYTES, ssd_size="20records"),
}


def test_the_schedules_are_what_the_tests_say(tmp_path: Path, ssd_dir: Path, small_blocks: None) -> None:
    ds = _ds(tmp_path, 12)
    plans = {name: TieredSampler(ds, ssd_dir=ssd_dir, batch_size=1, **kw).memory_plan  # type: ignore[arg-type]
             for name, kw in SCHEDULES.items()}  # fmt: skip
    assert (plans["tiny"].first_block, plans["tiny"].ram_block, plans["tiny"].static_records) == (1, 1, 0)
    grow = plans["growing+cache"]
    assert grow.first_block == 2 and grow.ram_block == 4 and 0 < grow.static_records < 12
    assert plans["all-cached"].full_cache and plans["all-cached"].cache_fraction == 1.0
    assert 0 < plans["ssd+cache"].static_records < 12 and plans["ssd+cache"].ssd_block is not None
    for name in ("growing+cache", "ssd+cache"):  # the budget covers the buffers, cache and copy buffer
        plan = plans[name]
        copy = plan.ssd_copy_bytes if plan.ssd_copy_bytes >= MIN_COPY_BYTES else 0  # one record is not counted
        assert plan.pool_bytes + plan.cache_bytes + copy <= plan.ram_bytes
    # The whole dataset cached: the cache fits, a few batch buffers come on top (documented).
    assert plans["all-cached"].cache_bytes <= plans["all-cached"].ram_bytes


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_exact_uniformity_per_schedule(tmp_path: Path, ssd_dir: Path, small_blocks: None, name: str) -> None:
    """Every schedule emits exactly pi in each epoch, hence an exactly uniform order: the scaled
    item x position chi-square with (N-1)^2 dof over many epochs."""
    n, epochs = 12, 600 if name != "ssd+cache" else 240
    ds = _ds(tmp_path, n)
    s = TieredSampler(ds, ssd_dir=ssd_dir, batch_size=1, epochs=epochs, seed=31, **SCHEDULES[name])  # type: ignore[arg-type]
    orders = np.concatenate(collect(s)).reshape(epochs, n)
    for e in (0, 1, epochs - 1):
        np.testing.assert_array_equal(orders[e], epoch_permutation(31, e, n))
    assert item_position_pvalue(orders) > ALPHA


@pytest.mark.parametrize("name", ["growing+cache", "all-cached"])
def test_batches_spanning_blocks(tmp_path: Path, small_blocks: None, name: str) -> None:
    """Batches of 3 over blocks of 2 then 4 records (and the cache's rows) come out whole and in order."""
    n = 23
    ds = _ds(tmp_path, n)
    kw = {**SCHEDULES[name], "ram_size": f"{n}records" if name == "all-cached" else "11records"}
    s = TieredSampler(ds, batch_size=3, epochs=2, seed=4, **kw)  # type: ignore[arg-type]
    batches = collect(s)
    assert [b.size for b in batches] == ([3] * 7 + [2]) * 2
    np.testing.assert_array_equal(np.concatenate(batches), np.concatenate([epoch_permutation(4, e, n) for e in range(2)]))


def test_first_block_is_small_then_blocks_grow(tmp_path: Path, passes: list[int]) -> None:
    """Real block rules, 150 KB records: the first read pass is about FIRST_BLOCK_BYTES (so the first
    batch waits for ~16 MiB, not for a block of the whole budget), the next ones are larger, and the
    reads follow block_bounds exactly."""
    n, shape = 300, (224, 224, 3)
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=64, shape=shape)
    rec = int(np.prod(shape))
    s = TieredSampler(ds, ram_size=3 * n * rec, batch_size=16, seed=1)  # the budget covers the dataset
    first, largest = s.block_schedule
    assert first * rec <= schedule.FIRST_BLOCK_BYTES + 16 * rec and first < largest
    assert first % 16 == 0 and largest % 16 == 0  # whole batches
    keys = np.concatenate(collect(s))
    np.testing.assert_array_equal(keys, epoch_permutation(1, 0, n))
    expected = [b - a for a, b in block_bounds(0, n, first, largest)]
    assert passes == expected and expected[0] == first and expected[1] == min(2 * first, n - first)


def test_storage_bytes_per_epoch(tmp_path: Path, small_blocks: None) -> None:
    """Disk bytes per epoch (indexes excluded, gap_bytes=0): the whole dataset in the first epoch;
    after it, exactly the uncached records (N - M) with a partial cache, and nothing when the budget
    covers the dataset."""
    n = 40
    ds = _ds(tmp_path, n)
    index = opening_nbytes(n, 5, REC)  # each shard's index (and records' end), read once per run
    for ram, expect_full in (("40records", True), ("33records", False), ("2records", False)):
        s = TieredSampler(ds, ram_size=ram, batch_size=2, epochs=4, seed=8, gap_bytes=0)
        keys = np.concatenate(collect(s)).reshape(4, n)
        for e in range(4):
            np.testing.assert_array_equal(keys[e], epoch_permutation(8, e, n))
        m = s.static_cache
        assert s.memory_plan.full_cache == expect_full and (m == n) == expect_full
        per_epoch = s.stats.disk_bytes_by_epoch
        assert s.stats.disk.bytes_read - sum(per_epoch.values()) == (index if expect_full else 0)
        if expect_full:  # the cache is the mapped files: each shard's index is checked as they are mapped
            assert per_epoch[0] == n * REC
        else:
            assert per_epoch[0] == n * REC + index  # every record once, plus each shard's index once
        assert [per_epoch.get(e, 0) for e in (1, 2, 3)] == [(n - m) * REC] * 3, (ram, m, per_epoch)
        assert s.cache_fraction == m / n
        s.close()


def test_larger_budgets_read_less(tmp_path: Path, small_blocks: None) -> None:
    """Over three epochs a larger budget never reads more from storage (the spare budget caches)."""
    n = 40
    ds = _ds(tmp_path, n)
    total = []
    for ram in ("4records", "20records", "33records", "40records", "80records"):
        s = TieredSampler(ds, ram_size=ram, batch_size=2, epochs=3, seed=8, gap_bytes=0)
        collect(s)
        total.append(s.stats.disk.bytes_read)
        s.close()
    assert total == sorted(total, reverse=True) and total[-1] < total[0] / 2


@pytest.mark.parametrize("tiers", ["ram", "ram,ssd"])
def test_resume_across_a_world_size_change(tmp_path: Path, ssd_dir: Path, small_blocks: None, tiers: str) -> None:
    """Two ranks (growing blocks, each with a cache) run 3 global batches; three ranks with another
    schedule continue the same global order and read only what is left (minus their cache hits)."""
    n, b = 50, 3
    ds = _ds(tmp_path, n)
    kw = dict(tiers=tiers, ram_size="20records", ssd_size="30records", ssd_dir=ssd_dir, batch_size=b, epochs=1, seed=21)
    pi = epoch_permutation(21, 0, n)
    got: dict[int, list[np.ndarray]] = {}
    states = []
    for r in range(2):
        s = TieredSampler(ds, rank=r, world_size=2, **kw)  # type: ignore[arg-type]
        it = iter(s)
        got[r] = [check_batch(next(it)) for _ in range(3)]
        states.append(s.state_dict())
        s.close()
    assert states[0] == states[1] and states[0]["position"] == 18
    np.testing.assert_array_equal(np.concatenate([got[r][g] for g in range(3) for r in range(2)]), pi[:18])
    cont: dict[int, list[np.ndarray]] = {}
    plans = set()
    for r in range(3):
        s = TieredSampler(ds, rank=r, world_size=3, **kw)  # type: ignore[arg-type]
        plans.add(s.block_schedule)
        s.load_state_dict(states[0])
        cont[r] = collect(s)
        assert s.stats.disk.records + s.stats.cache.records == sum(x.size for x in cont[r])
        s.close()
    rebuilt = [cont[r][g] for g in range(max(map(len, cont.values()))) for r in range(3) if g < len(cont[r])]
    np.testing.assert_array_equal(np.concatenate(rebuilt), pi[18:])


def test_read_efficiency_model() -> None:
    """The density model: large records read near sequential speed at any density, tiny ones only
    when blocks are nearly the whole dataset; efficiency never exceeds 1 and is 1 at density 1."""
    big, small = 150_528, 16
    assert all(0.9 <= read_efficiency(d, big, 1 << 16) <= 1 for d in (0.0, 0.01, 0.2, 1.0))
    assert read_efficiency(0.01, small, 1 << 16) < 0.05 and read_efficiency(1.0, small, 1 << 16) == 1.0
    assert schedule.density_block(1000, big, 1 << 16) == 1 and schedule.density_block(1000, small, 1 << 16) >= 900
    assert list(block_bounds(0, 10, 1, 4)) == [(0, 1), (1, 3), (3, 7), (7, 10)]
    assert list(block_bounds(5, 6, 8, 8)) == [(5, 6)]


def test_first_block_of_small_records_is_a_bounded_number_of_records() -> None:
    """32-byte records (issue #34): the first block is at most FIRST_BLOCK_RECORDS records (a few
    batches), not FIRST_BLOCK_BYTES of them (half a million records sorted and planned before the first
    batch); still at least one batch, and whole batches."""
    for batch in (64, 4096, 100_000):
        first, largest = schedule.block_limits(10**8, 32, batch, 10**7, 64 << 10, 10**7)
        assert first <= max(batch, schedule.FIRST_BLOCK_RECORDS) and first >= batch and first % batch == 0
        assert largest > first
    # large records are unchanged: about FIRST_BLOCK_BYTES
    first, _ = schedule.block_limits(10**6, 150528, 16, 10**6, 64 << 10, 10**6)
    assert first == (-(-schedule.FIRST_BLOCK_BYTES // 150528)) // 16 * 16


def test_first_block_is_shared_by_a_ranks_workers(tmp_path: Path) -> None:
    """A rank's DataLoader workers read their first blocks together and its first batch is worker
    0's: each worker's first block is about FIRST_BLOCK_BYTES / workers, so the rank's first reads
    stay about FIRST_BLOCK_BYTES (a worker's first batch waited for twice its share with 2 workers);
    the order is the same."""
    rec = 131072
    alone, largest = schedule.block_limits(10**6, rec, 16, 10**5, 64 << 10, 10**5)
    shared, largest2 = schedule.block_limits(10**6, rec, 16, 10**5, 64 << 10, 10**5, sharers=2)
    assert alone == schedule.FIRST_BLOCK_BYTES // rec and shared == alone // 2 and largest2 == largest
    assert schedule.block_limits(10**6, rec, 64, 10**5, 64 << 10, 10**5, sharers=8)[0] == 64  # at least a batch
    n, shape = 300, (224, 224, 3)
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=64, shape=shape)
    size = int(np.prod(shape))
    kw: dict[str, Any] = {"ram_size": 3 * n * size, "batch_size": 8, "seed": 1, "world_size": 2}
    one = TieredSampler(ds, **kw, workers_per_rank=1)
    two = TieredSampler(ds, **kw, workers_per_rank=2)
    assert two.block_schedule[0] * 2 == one.block_schedule[0] and two.block_schedule[1] == one.block_schedule[1]
    np.testing.assert_array_equal(np.concatenate(collect(two)), np.concatenate(collect(one)))
