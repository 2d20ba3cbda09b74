"""Per-block memory and work of many small records (issues 34 and 33): steady state allocates no
block-sized temporaries, and a mixture's block is sorted and planned once, not once per dataset.

Freed block-sized arrays stay in glibc's thread arenas, so every block-sized temporary of the read
path shows up in a consumer's peak RSS; these tests measure the traced (numpy) allocations of one
call, which is what the fixes bound.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset
from shardkit.formats import reader as reader_module
from shardkit.formats.reader import Destination
from shardkit.tiers.static_cache import SortedKeys
from tests.helpers.sampler_data import FIVE_WAY_STARTS, encode, five_way_mixture


def _peak(fn: object) -> int:
    """Bytes allocated (traced) at the peak of ``fn()`` above what was allocated before it."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _small_records(path: Path, n: int) -> Path:
    """``n`` records of 8 bytes, record ``i`` holding ``i`` (little-endian int64)."""
    with DatasetWriter(path, kind="test", payload="x", record=FieldSpec((8,), "uint8"), fields={},
                       records_per_shard=1 << 18) as w:  # fmt: skip
        for a in range(0, n, 1 << 20):
            w.write({"x": np.arange(a, min(n, a + (1 << 20)), dtype="<i8").view(np.uint8).reshape(-1, 8)})
    return path


def test_a_repeated_block_read_allocates_no_block_sized_sort(tmp_path: Path) -> None:
    """The second read of a block of the same size reuses the sort's arrays (key and position packed,
    positions, duplicate flags): it allocates less than one int64 per key (before: three)."""
    n, k = 1 << 21, 1 << 21
    path = _small_records(tmp_path / "ds", n)
    keys = np.random.default_rng(1).permutation(n)[:k]
    out = np.empty((k, 8), dtype=np.uint8)
    with open_dataset(path) as ds:
        ds.payload.read(keys[:1000])  # opens and checks every shard touched below
        ds.payload.read(np.arange(n, dtype=np.int64)[:: 1 << 17])
        ds.payload.read(keys, out)
        assert np.array_equal(out.view("<i8").reshape(-1), keys)
        out[:] = 0
        dest = Destination.rows_of(out, k)
        peak = _peak(lambda: ds.payload.read_into(keys, dest))
    assert np.array_equal(out.view("<i8").reshape(-1), keys)
    assert peak < 8 * k, f"a repeated read of {k} keys allocated {peak / 2**20:.1f} MiB"


def test_the_rows_check_gathers_nothing_for_a_block_of_batches() -> None:
    """Destination.check of a block over many equal batch buffers compares every row with the
    smallest buffer, without an int64 gather per record, and still refuses a row out of its buffer."""
    k, bs = 1 << 20, 4096
    buffers = tuple(np.empty((bs, 4), dtype=np.uint8) for _ in range(k // bs))
    which = (np.arange(k, dtype=np.int32) // bs).astype(np.int32)
    rows = (np.arange(k, dtype=np.int32) % bs).astype(np.int32)
    dest = Destination(buffers, which, rows)
    assert _peak(lambda: dest.check(k, (4,), np.dtype(np.uint8), "x")) < k
    short = Destination((*buffers[:-1], np.empty((bs - 1, 4), dtype=np.uint8)), which, rows)
    with pytest.raises(shardkit.errors.ConfigError, match="outside their buffers"):
        short.check(k, (4,), np.dtype(np.uint8), "x")


def test_pinned_key_lookup_keeps_one_int64_per_key() -> None:
    """SortedKeys.lookup of a block: its result (a row per key and a hit flag) and bounded pieces,
    not four block-sized int64 temporaries."""
    pinned = SortedKeys(np.sort(np.random.default_rng(2).choice(10**7, 8192, replace=False)).astype(np.int64))
    keys = np.random.default_rng(3).integers(0, 10**7, 1 << 21).astype(np.int64)
    hit, row = pinned.lookup(keys)
    expected = np.isin(keys, pinned.keys())
    assert np.array_equal(hit, expected) and np.array_equal(pinned.keys()[row[hit]], keys[hit])
    assert _peak(lambda: pinned.lookup(keys)) < 10 * keys.size


def test_a_mixture_block_is_sorted_and_planned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five local datasets: one sort of the block's global keys, each dataset's slice read in place
    (never through the part's own read_into), every record (duplicates included) in its row, and
    each dataset's shards read in ascending offsets as before."""
    with five_way_mixture(tmp_path) as (payload, stats, paths):
        before = stats.records
        sorts: list[int] = []
        real_sort = reader_module._sorted_with_order
        monkeypatch.setattr(reader_module, "_sorted_with_order",
                            lambda keys, *a, **kw: sorts.append(keys.size) or real_sort(keys, *a, **kw))  # fmt: skip
        monkeypatch.setattr(reader_module.PayloadArray, "read_into", lambda *a, **kw: pytest.fail("per-part read_into"))
        keys = np.random.default_rng(4).integers(0, int(FIVE_WAY_STARTS[-1]), 60)  # duplicates included
        buffers = (np.zeros((32, 4, 4, 1), np.uint8), np.zeros((28, 4, 4, 1), np.uint8))
        which = (np.arange(60) >= 32).astype(np.int32)
        rows = np.where(which == 0, np.arange(60), np.arange(60) - 32).astype(np.int32)
        payload.read_into(keys, Destination(buffers, which, rows))
    assert sorts == [60]
    got = np.concatenate([b.reshape(b.shape[0], -1) for b in buffers])
    assert np.array_equal(got, encode(keys).reshape(60, -1))
    assert stats.records - before == 60
    for i in range(5):  # each dataset's requests: its shards in order, ascending offsets within each
        mine = [(int(f.split("/c/")[1].split("/")[0]), off) for f, off, _ in stats.trace if f.startswith(f"{paths[i]}/")]
        assert mine and mine == sorted(mine)


class _SmallCache:
    """A static cache of a few pinned keys, half of them filled, all with memory (for
    :meth:`Pipeline._cache_plan`)."""

    def __init__(self, pinned: SortedKeys) -> None:
        self.pinned = pinned

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.pinned.lookup(keys)

    def filled(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows % 2 == 0)

    def reserve(self, rows: np.ndarray, ahead: object = None) -> np.ndarray:
        return np.ones(rows.shape, dtype=bool)


def test_a_blocks_cache_plan_keeps_only_the_hits() -> None:
    """A block of 2**21 keys against a static cache of 8,192 pinned keys (the auto cache's leftover
    at 10^7 small records): the plan is the hits' positions, rows and fill flags, looked up a piece
    at a time, so it allocates under a byte per key (before: a row per key, int64, and two flags)."""
    from types import SimpleNamespace

    from shardkit.tiers.pipeline import Pipeline

    pinned = SortedKeys(np.sort(np.random.default_rng(2).choice(10**7, 8192, replace=False)).astype(np.int64))
    keys = np.random.default_rng(3).integers(0, 10**7, 1 << 21).astype(np.int64)
    owner = SimpleNamespace(cache=_SmallCache(pinned))
    pos, row, fill = Pipeline._cache_plan(owner, keys)  # type: ignore[arg-type]
    hit = np.isin(keys, pinned.keys())
    assert np.array_equal(pos, np.flatnonzero(hit)) and pos.size > 0
    assert np.array_equal(pinned.keys()[row], keys[pos])
    assert np.array_equal(fill, row % 2 == 1)
    assert _peak(lambda: Pipeline._cache_plan(owner, keys)) < keys.size  # type: ignore[arg-type]
