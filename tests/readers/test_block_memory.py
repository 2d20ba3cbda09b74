"""Memory of many small records (issue 34): a block's bookkeeping is part of ``ram_size``.

A block record costs ``BLOCK_RECORD_BYTES`` besides the record (its key, its buffer and row, the
read's sort); for 32-byte records that is most of a record, so blocks sized by the records' bytes
alone took about 1.75x ``ram_size``. The plan must fit batch buffers, the static cache and that
bookkeeping in the budget; large records keep (almost) the same blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.order.schedule import BLOCK_RECORD_BYTES, STAGED_RECORD_BYTES
from shardkit.readers import TieredSampler, epoch_permutation
from shardkit.readers.options import SamplerOptions
from tests.helpers.sampler_data import collect, make_dataset


@pytest.mark.parametrize("rec", [8, 32, 1024, 150_528])
@pytest.mark.parametrize("static_cache", ["auto", "0"])
def test_buffers_cache_and_block_bookkeeping_fit_the_ram_budget(rec: int, static_cache: str) -> None:
    ram, batch, n = 256 << 20, 4096 if rec < 1024 else 16, 10**9 // rec
    sizes = SamplerOptions(ram_size=ram, batch_size=batch, static_cache=static_cache).tier_sizes(rec, n)
    buffers = sizes.pool_bytes  # batch buffers, and a staged plan's two staging blocks
    per_record = STAGED_RECORD_BYTES if sizes.staged else BLOCK_RECORD_BYTES
    bookkeeping = 2 * sizes.ram_block * per_record
    assert buffers + bookkeeping + sizes.static_records * rec <= ram
    if rec <= 32:  # ... and small records' blocks still take most of it (the density rule wants all)
        assert sizes.ram_block * (rec + per_record) * 2 >= ram * 3 // 4


def test_staged_blocks_charge_their_own_bookkeeping() -> None:
    """A staged block of keys below 2**31 keeps int32 keys and its sort's order in the slot's own
    arrays: STAGED_RECORD_BYTES a record, so 32-byte records get blocks (32 + 24) / (32 + 16) times
    larger in the same budget (fewer passes over a large dataset); replacement mode's duplicates
    are charged more."""
    ram, batch, rec = 256 << 20, 4096, 32
    sizes = SamplerOptions(ram_size=ram, batch_size=batch, static_cache=0).tier_sizes(rec, 10**8)
    assert sizes.staged
    room = ram - sizes.pool_bytes + 2 * sizes.ram_block * rec  # the budget besides the batches in flight
    assert room - 2 * batch * (rec + STAGED_RECORD_BYTES) < 2 * sizes.ram_block * (rec + STAGED_RECORD_BYTES) <= room
    again = SamplerOptions(ram_size=ram, batch_size=batch, static_cache=0, mode="replacement").tier_sizes(rec, 10**8)
    assert again.staged and again.ram_block < sizes.ram_block


def test_a_staged_block_keeps_int32_keys_and_its_own_sort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys of a staged block are int32, and each staging slot's sort (order, duplicates) is its
    own: the next block's sort, into the other slot, leaves it for the assembler."""
    from shardkit.tiers import pipeline

    seen: list[np.dtype] = []
    real = pipeline.Pipeline._read_staged

    def spy(self: pipeline.Pipeline, seg: pipeline.Segment, a: int, b: int, keys: np.ndarray, *args: object) -> object:
        seen.append(keys.dtype)
        return real(self, seg, a, b, keys, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline.Pipeline, "_read_staged", spy)
    ds = make_dataset(tmp_path / "ds", 3000, records_per_shard=500, shape=(8,))
    s = TieredSampler(ds, batch_size=100, seed=5, ram_size="40KiB", static_cache=0)
    assert s.memory_plan.staged
    np.testing.assert_array_equal(np.concatenate(collect(s)), epoch_permutation(5, 0, 3000))
    assert len(seen) > 2 and set(seen) == {np.dtype(np.int32)}

    sorts = pipeline._StageSorts(8)
    sorts.slot = 0
    first = pipeline.SortedRequest.of(np.array([5, 1, 4, 1]), 10, sorts)
    kept = first.order.copy(), None if first.dup is None else first.dup.copy()
    sorts.slot = 1
    pipeline.SortedRequest.of(np.array([2, 9, 3, 0]), 10, sorts)
    np.testing.assert_array_equal(first.order, kept[0])
    assert first.dup is not None and kept[1] is not None
    np.testing.assert_array_equal(first.dup, kept[1])


def test_block_keys_are_computed_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's keys come from its positions a piece at a time (bounded temporaries), in order,
    for every consumer of a global batch."""
    from shardkit.tiers import pipeline

    monkeypatch.setattr(pipeline, "_KEY_PIECE", 3)
    ds = make_dataset(tmp_path / "ds", 40, records_per_shard=7)
    keys = []
    for rank in range(2):
        s = TieredSampler(ds, batch_size=4, seed=3, rank=rank, world_size=2, ram_size="40records")
        keys.append(np.concatenate(collect(s)))
    pi = epoch_permutation(3, 0, 40).reshape(-1, 2, 4)
    for rank in range(2):
        np.testing.assert_array_equal(keys[rank], pi[:, rank].reshape(-1))



def test_the_auto_cache_pins_nothing_that_would_spare_under_one_percent_of_the_reads() -> None:
    """10^7 records of 32 bytes in 256 MiB: the blocks leave room for 8,192 records, which would
    spare 0.08% of the reads while each of a block's 2.4 M records is looked up in them: auto pins
    none (an explicit size still pins). Large records' blocks are small, so their leftover is kept
    even when it is under 1% of the records."""
    ram, batch = 256 << 20, 4096
    assert SamplerOptions(ram_size=ram, batch_size=batch).tier_sizes(32, 10**7).static_records == 0
    explicit = SamplerOptions(ram_size=ram, batch_size=batch, static_cache="8192records")
    assert explicit.tier_sizes(32, 10**7).static_records == 8192
    images = SamplerOptions(ram_size=1 << 30, batch_size=16).tier_sizes(150_528, 10**6)
    assert images.ram_block < images.static_records < 10**6 // 100
