"""The schedule is the one owner of the global-batch arithmetic and the block rules: its counts agree with
the plans it builds and with what the real sampler delivers; every sampler implements the Sampler
protocol the adapters rely on."""

from __future__ import annotations

import itertools
import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from shardkit.order.schedule import (
    BATCH_PREFETCH,
    batches_per_consumer,
    consumer_plan,
    consumer_records_bound,
    consumer_slice,
    epoch_share,
    position_after,
    ram_block,
    records_per_consumer,
    ssd_block,
)
from shardkit.readers import Sampler, SharedSampler, TieredSampler, TierServer
from tests.helpers.sampler_data import collect, make_dataset

GRID = list(itertools.product([0, 1, 7, 12, 13, 30], [1, 2, 5], [1, 2, 3], [False, True], [0, 4, 11]))


@pytest.mark.parametrize("n,b,w,drop_last,start", GRID)
def test_counts_slices_and_plans_agree(n: int, b: int, w: int, drop_last: bool, start: int) -> None:
    """For every consumer: the plan's batches are the consumer_slice of each global batch, and the counts
    are the plan's; the consumers' slices tile the positions the plan covers."""
    stream = np.arange(n, dtype=np.int64) * 10  # distinct keys, so slices can be compared by value
    covered: list[int] = []
    for c in range(w):
        plan = consumer_plan(stream, start, b, c, w, drop_last)
        share = epoch_share(n, b, c, w, drop_last=drop_last, start=start)
        assert share.batches == plan.num_batches == batches_per_consumer(n, b, c, w, drop_last=drop_last, start=start)
        assert share.records == plan.keys.size == records_per_consumer(n, b, c, w, drop_last=drop_last, start=start)
        assert plan.keys.size <= consumer_records_bound(n, b, w)
        ends = np.cumsum(plan.batch_sizes)
        for g in range(plan.num_batches):
            lo, hi = consumer_slice(g, n, b, c, w, drop_last=drop_last, start=start)  # type: ignore[misc]
            np.testing.assert_array_equal(plan.keys[ends[g] - plan.batch_sizes[g] : ends[g]], stream[lo:hi])
            covered += list(range(lo, hi))
        assert consumer_slice(plan.num_batches, n, b, c, w, drop_last=drop_last, start=start) is None
    rest = max(0, n - start)
    expect = rest - rest % (b * w) if drop_last else rest
    assert sorted(covered) == list(range(start, start + expect))


def test_position_after_and_block_rules() -> None:
    assert position_after(4, 3, 2, 3, 100) == 4 + 3 * 6
    assert position_after(4, 30, 2, 3, 100) == 100
    rec, b = 16, 4
    reserve = (BATCH_PREFETCH + 2) * b * rec
    assert ram_block(4 * reserve, rec, b, 10**6) == (4 * reserve - reserve) // (2 * rec)  # batches reserved
    assert ram_block(reserve, rec, b, 10**6) == reserve // (2 * rec)  # too small to reserve: all for blocks
    assert ram_block(2 * rec, rec, b, 10**6) == 1
    assert ram_block(10**9, rec, b, 37) == 37  # never larger than a consumer's epoch
    assert ssd_block(20 * rec, rec, 10**6) == 10 and ssd_block(20 * rec, rec, 3) == 3


@pytest.mark.parametrize("n,b,w,drop_last", [(37, 4, 3, False), (37, 4, 3, True), (5, 8, 2, False), (40, 4, 4, False)])
def test_sampler_len_is_the_schedules(tmp_path: Path, n: int, b: int, w: int, drop_last: bool) -> None:
    ds = make_dataset(tmp_path / "ds", n)
    for c in range(w):
        s = TieredSampler(ds, batch_size=b, rank=c, world_size=w, drop_last=drop_last, ram_size="6records")
        batches = collect(s)
        assert len(s) == len(batches) == batches_per_consumer(n, b, c, w, drop_last=drop_last)
        assert sum(x.size for x in batches) == records_per_consumer(n, b, c, w, drop_last=drop_last)
        assert s.ram_block == ram_block(6 * 16, 16, b, consumer_records_bound(n, b, w))


def test_tiered_sampler_implements_the_protocol(tmp_path: Path) -> None:
    s = TieredSampler(make_dataset(tmp_path / "ds", 5))
    assert isinstance(s, Sampler)
    assert (s.path, s.num_records, s.batch_size, s.payload_name, s.epoch) == (tmp_path / "ds", 5, 256, "image", 0)


def test_shared_sampler_lacks_only_the_resume_methods(tmp_path: Path) -> None:
    """SharedSampler (rewritten elsewhere) already offers every member the adapters use; it still has to
    add ``set_epoch`` and ``load_state_dict`` (which may simply raise) to declare the whole protocol."""
    ds = make_dataset(tmp_path / "ds", 12)
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    members = [m for m in vars(Sampler) if not m.startswith("_")] + ["__iter__", "__len__", "__enter__", "__exit__"]
    assert {"element_spec", "state_dict", "load_state_dict", "set_epoch", "close", "stats", "epoch"} <= set(members)
    with TierServer(ds, name=name, ram_size="6records"):
        shared = SharedSampler(name, batch_size=3)
        try:
            missing = {m for m in members if not hasattr(shared, m)}
        finally:
            shared.close()
    assert missing <= {"set_epoch", "load_state_dict"}, missing
