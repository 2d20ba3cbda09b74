"""DataLoader workers hand batches to the main process by handle (shardkit.adapters._handover).

What is proved: the main process's payload is the worker's shared buffer itself (no copy), the
worker reuses a buffer only after the main process let go of every view of it, batches the main
process keeps are never overwritten (their buffers are retired), the order and exactly-once
contract holds, a collate_fn that replaces the payload still gets an ordinary batch, and the main
process keeps each worker buffer mapped while the worker lives (not mapped anew per batch).
"""

from __future__ import annotations

import copy
import gc
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing
from _adapter_data import N_KEYED, SHAPE, decode_keys

from shardkit.adapters import _handover
from shardkit.adapters._handover import SharedBatch, SharedBatchMemory, shared_batch
from shardkit.adapters.torch import ShardIterableDataset, to_tensors
from shardkit.readers import epoch_permutation

SEED = 11


def _worker_batch(rows: int = 4) -> tuple[SharedBatchMemory, np.ndarray, dict[str, torch.Tensor]]:
    memory = SharedBatchMemory(extra_hold=2)
    array = memory.allocate(rows, SHAPE, np.dtype(np.uint8))
    array[:] = 7
    batch = {"image": array, "label": np.arange(rows, dtype=np.int64), "key": np.arange(rows, dtype=np.int64)}
    return memory, array, shared_batch(batch, "image", to_tensors(batch, "image"))


def test_pickled_batch_views_the_worker_buffer_until_released() -> None:
    memory, array, batch = _worker_batch()
    assert isinstance(batch, SharedBatch)
    owner = array.base
    assert not memory.busy(owner)
    wire = ForkingPickler.dumps(batch)
    assert len(wire) < 4096  # a handle and the small fields, not the 4 x 192 bytes... nor a copy
    assert memory.busy(owner)  # sent, not yet received
    received = ForkingPickler.loads(wire)
    assert type(received) is dict and list(received) == ["image", "label", "key"]
    np.testing.assert_array_equal(received["label"].numpy(), np.arange(4))
    # The same memory: what the worker writes shows in the main process's tensor.
    array[1, 2, 3, 0] = 99
    assert int(received["image"][1, 2, 3, 0]) == 99
    view = received["image"][2:]  # a view keeps the batch held
    del received
    gc.collect()
    assert memory.busy(owner)
    del view
    gc.collect()
    assert not memory.busy(owner)


def test_a_segments_descriptor_is_sent_with_its_first_batch_only() -> None:
    """The main process keeps every segment it received mapped while the worker lives, so a later
    batch of the same buffer travels as the segment's identity: no file descriptor, no round trip
    to the worker's resource sharer; it views the same memory and is released as before."""
    memory, array, batch = _worker_batch()
    owner = array.base
    first = bytes(ForkingPickler.dumps(batch))
    assert b"rebuild_storage_fd" in first  # the descriptor, with the first batch
    received = ForkingPickler.loads(first)
    del received
    gc.collect()
    assert not memory.busy(owner)
    array[0, 1, 2, 0] = 42  # the worker reads the next batch into the same buffer
    again = bytes(ForkingPickler.dumps(batch))
    assert b"rebuild_storage_fd" not in again and b"DupFd" not in again
    assert memory.busy(owner)
    received = ForkingPickler.loads(again)
    assert int(received["image"][0, 1, 2, 0]) == 42
    array[3, 0, 0, 0] = 5
    assert int(received["image"][3, 0, 0, 0]) == 5  # the same memory, not a copy
    np.testing.assert_array_equal(received["label"].numpy(), np.arange(4))
    del received
    gc.collect()
    assert not memory.busy(owner)


def test_a_batch_of_a_segment_never_received_is_refused() -> None:
    _, _, batch = _worker_batch()
    ForkingPickler.dumps(batch)  # sent with its descriptor, but never unpickled here
    with pytest.raises(RuntimeError, match="never received"):
        ForkingPickler.loads(ForkingPickler.dumps(batch))


def test_copy_counts_no_send_and_replaced_payload_travels_as_a_copy() -> None:
    memory, array, batch = _worker_batch()
    clone = copy.copy(batch)
    assert isinstance(clone, SharedBatch) and not memory.busy(array.base)
    clone["image"] = clone["image"].clone()  # what a transforming collate_fn does
    received = ForkingPickler.loads(ForkingPickler.dumps(clone))
    assert not memory.busy(array.base)
    array[0, 0, 0, 0] = 1
    assert int(received["image"][0, 0, 0, 0]) == 7  # its own memory


def _keys(batch: dict[str, torch.Tensor]) -> np.ndarray:
    keys = batch["key"].numpy()
    np.testing.assert_array_equal(decode_keys(batch["image"].numpy()), keys)
    return keys


class _PoolDataset(ShardIterableDataset):
    """Appends per worker what its pool did: buffers allocated, retired, capacity, shared or not."""

    def __iter__(self):  # type: ignore[override]
        yield from super().__iter__()
        pool = self._sampler._pool  # type: ignore[union-attr]
        shared = isinstance(pool.memory, SharedBatchMemory)
        yield {"pool": torch.tensor([pool.allocated, pool.retired, pool.capacity, int(shared)])}


def test_workers_reuse_shared_buffers_in_order(keyed: Path) -> None:
    ds = _PoolDataset(keyed, batch_size=4, seed=SEED, num_workers=2, ram_size="4KiB", static_cache=0)
    loader = ds.loader(num_workers=2)
    for epoch in range(2):
        keys, pools = [], []
        for batch in loader:
            if "pool" in batch:
                pools.append(batch["pool"].tolist())
            else:
                keys.append(_keys(batch))
        np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, epoch, N_KEYED))
        assert len(pools) == 2
        for allocated, retired, capacity, shared in pools:
            # 13 batches per worker through a pool of fewer buffers: they were reused, none retired.
            assert shared == 1 and retired == 0 and allocated <= capacity < 13, pools


def test_batches_kept_by_the_main_process_are_never_overwritten(keyed: Path) -> None:
    ds = _PoolDataset(keyed, batch_size=4, seed=SEED, num_workers=2, ram_size="4KiB", static_cache=0)
    kept = list(ds.loader(num_workers=2))
    pools = [b["pool"].tolist() for b in kept if "pool" in b]
    assert all(retired > 0 for _, retired, _, _ in pools), pools  # the pool had to give buffers up
    keys = np.concatenate([_keys(b) for b in kept if "pool" not in b])
    np.testing.assert_array_equal(keys, epoch_permutation(SEED, 0, N_KEYED))


class _SegmentsDataset(ShardIterableDataset):
    """Appends per worker and pass: the pool's allocations, and the segments its memory created."""

    def __iter__(self):  # type: ignore[override]
        yield from super().__iter__()
        pool = self._sampler._pool  # type: ignore[union-attr]
        worker = torch.utils.data.get_worker_info().id  # type: ignore[union-attr]
        yield {"segments": torch.tensor([worker, pool.allocated, pool.memory.created])}


def test_later_passes_reuse_the_shared_buffers_of_earlier_ones(keyed: Path) -> None:
    """A persistent worker's pools draw on one memory: buffers of a finished pass that the main
    process released are reused, so four passes create at most two passes' worth of segments (the
    next pass's pool starts while the current one's last batches are handed over) instead of a
    new set every pass, and the records stay right."""
    ds = _SegmentsDataset(keyed, batch_size=4, seed=SEED, num_workers=2, static_cache=0)
    loader = ds.loader(num_workers=2)
    allocated: dict[int, list[int]] = {0: [], 1: []}
    created: dict[int, int] = {}
    for epoch in range(4):
        keys, marks = [], []
        for batch in loader:
            if "segments" in batch:
                marks.append(batch["segments"].tolist())
            else:
                keys.append(_keys(batch))
        np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, epoch, N_KEYED))
        for w, pool_allocated, segments in marks:
            allocated[w].append(pool_allocated)
            created[w] = segments
    for w in (0, 1):
        assert sum(allocated[w]) > 2 * max(allocated[w])  # without reuse, every allocation is a new segment
    assert max(created.values()) <= 2 * max(max(a) for a in allocated.values()), (created, allocated)


def test_the_next_pass_starts_reading_once_its_pass_is_over(keyed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent worker builds its next pass's sampler during its pass but starts its reading only
    once its pass's sampler is closed: started earlier, the next pass's pool took a second set of
    shared segments while this pass's still held its blocks (twice the worker's RAM budget, faulted
    in again in the worker and in the main process) and its reads competed with this pass's."""
    from shardkit.adapters import torch as adapter

    monkeypatch.setattr(adapter, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=1))
    ds = ShardIterableDataset(keyed, batch_size=4, seed=SEED, static_cache=0)
    ds.loader(num_workers=1)  # persistent workers: every pass prepares the next one
    keys = []
    try:
        for batch in ds:
            keys.append(_keys(batch))
            assert ds._next is None or not ds._next._state.start, f"the next pass started after {len(keys)} batches"
        assert ds._next is not None and ds._next._state.start
        np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, 0, N_KEYED))
        assert len(keys) > 2
    finally:
        ds.close()


def test_collate_fn_replacing_the_payload(keyed: Path) -> None:
    def collate(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "image": batch["image"].flip(0).flip(0).contiguous()}

    ds = ShardIterableDataset(keyed, batch_size=8, seed=SEED, num_workers=2)
    keys = np.concatenate([_keys(b) for b in ds.loader(num_workers=2, collate_fn=collate)])
    np.testing.assert_array_equal(keys, epoch_permutation(SEED, 0, N_KEYED))


def test_main_process_keeps_each_worker_buffer_mapped(keyed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer that comes back is found mapped already (PyTorch's cache of shared storages), not
    mapped again and its pages faulted in again for every batch; the records stay right."""
    from torch.multiprocessing import reductions

    fresh: list[object] = []
    lookup = reductions.storage_from_cache

    def counted(cls: Any, key: Any) -> Any:
        storage = lookup(cls, key)
        if storage is None:
            fresh.append(key)
        return storage

    monkeypatch.setattr(reductions, "storage_from_cache", counted)
    ds = _SegmentsDataset(keyed, batch_size=4, seed=SEED, num_workers=2, ram_size="4KiB", static_cache=0)
    loader = ds.loader(num_workers=2)
    batches, passes = 0, 4
    created = {}
    for epoch in range(passes):
        keys = []
        for batch in loader:  # each batch dropped before the next arrives, as a training step does
            if "segments" in batch:
                created[int(batch["segments"][0])] = int(batch["segments"][2])
            else:
                keys.append(_keys(batch))
                batches += 1
        np.testing.assert_array_equal(np.concatenate(keys), epoch_permutation(SEED, epoch, N_KEYED))
    # Mapped anew: each segment once, and each worker's "segments" mark of each pass (a tensor of its own).
    assert sum(created.values()) < batches and len(fresh) <= sum(created.values()) + 2 * passes, (fresh, created, batches)


def test_buffers_of_exited_workers_are_let_go(keyed: Path) -> None:
    ds = ShardIterableDataset(keyed, batch_size=4, seed=SEED, num_workers=2, static_cache=0)
    loader = ds.loader(num_workers=2)
    iterator = iter(loader)
    pids = {w.pid for w in iterator._workers}  # type: ignore[attr-defined]
    assert sum(1 for _ in iterator) > 0
    assert {pid for pid, _, _ in _handover.kept_segments()} & pids
    del iterator, loader
    gc.collect()
    assert not {pid for pid, _, _ in _handover.kept_segments()} & pids


def test_a_buffer_past_the_start_of_its_segment_arrives_at_the_same_offset() -> None:
    # Batch buffers of RGB JPEG records start 16 bytes past a page (BatchPool(row_offset=)); the main
    # process views the worker's segment at the offset the worker's array has.
    memory = SharedBatchMemory(extra_hold=2)
    array = memory.allocate(4, SHAPE, np.dtype(np.uint8), offset=16)
    assert array.ctypes.data % 4096 == 16 and array.ctypes.data - array.base.ctypes.data == 16
    array[:] = np.arange(array.size, dtype=np.int64).reshape(array.shape) % 251
    batch = {"image": array, "label": np.arange(4, dtype=np.int64), "key": np.arange(4, dtype=np.int64)}
    received = ForkingPickler.loads(ForkingPickler.dumps(shared_batch(batch, "image", to_tensors(batch, "image"))))
    np.testing.assert_array_equal(received["image"].numpy(), array)
    array[3, 0, 0, 0] = 250
    assert int(received["image"][3, 0, 0, 0]) == 250  # the same memory, not a copy
    del received
    gc.collect()
    segment = array.base.ctypes.data
    del array, batch
    gc.collect()
    again = memory.allocate(4, SHAPE, np.dtype(np.uint8), offset=16)  # the free segment is reused
    assert again.base.ctypes.data == segment and again.ctypes.data == segment + 16 and memory.created == 1
