"""Batch buffers handed over without a copy (issue 18): never overwritten while referenced, recycled
(no allocation) when dropped, retired (not waited for) when the consumer keeps them."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import open_dataset
from shardkit.readers import TieredSampler, epoch_permutation
from shardkit.stopping import Stopped
from shardkit.tiers.buffers import HOLD_BATCHES, BatchPool
from tests.helpers.sampler_data import check_batch, make_dataset

SHAPE = (8, 8, 4)


def test_pool_recycles_only_unreferenced_buffers() -> None:
    pool = BatchPool(4, (3,), np.dtype(np.uint8), capacity=3)
    stop = threading.Event()
    a, b = pool.acquire(stop), pool.acquire(stop)
    assert a is not b and pool.allocated == 2
    held = a.array[:2]  # the consumer keeps a view of a
    pool.hand_over(a)
    pool.hand_over(b)
    c = pool.acquire(stop)
    assert c is b  # b is free, a is not
    also_held = c.array[1:]
    pool.hand_over(c)
    d = pool.acquire(stop)  # a and b held: a third buffer is allocated
    assert d is not a and d is not b and pool.allocated == 3
    del held
    pool.hand_over(d)
    assert pool.acquire(stop) in (a, d) and pool.allocated == 3
    del also_held


class _ElsewhereMemory:
    """A BufferMemory whose buffers another process may hold (``held`` says which, by owner id)."""

    extra_hold = 3

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.allocations = 0

    def allocate(self, rows: int, record_shape: tuple[int, ...], dtype: np.dtype, offset: int = 0) -> np.ndarray:
        self.allocations += 1
        raw = np.empty(rows * int(np.prod(record_shape)) * dtype.itemsize + 64, np.uint8)
        return raw[: rows * int(np.prod(record_shape)) * dtype.itemsize].view(dtype).reshape((rows, *record_shape))

    def busy(self, owner: np.ndarray) -> bool:
        return id(owner) in self.held


def test_pool_with_memory_elsewhere_waits_for_the_other_process() -> None:
    memory = _ElsewhereMemory()
    pool = BatchPool(4, (3,), np.dtype(np.uint8), capacity=2, memory=memory)
    assert pool.capacity == 2 + 3 and pool.hold == HOLD_BATCHES + 3
    stop = threading.Event()
    a = pool.acquire(stop)
    assert memory.allocations == 1 and a.array.shape == (4, 3)
    memory.held.add(id(a.owner))  # handed to the other process
    pool.hand_over(a)
    b = pool.acquire(stop)
    assert b is not a and memory.allocations == 2  # a is busy elsewhere though nothing here holds it
    memory.held.clear()  # released
    pool.hand_over(b)
    assert pool.acquire(stop) in (a, b) and memory.allocations == 2


def test_pool_keeps_views_of_every_kind_alive() -> None:
    torch = pytest.importorskip("torch")
    pool = BatchPool(4, (3,), np.dtype(np.uint8), capacity=1, hold=10)
    stop = threading.Event()
    buf = pool.acquire(stop)
    keepers = [lambda v: torch.from_numpy(v), lambda v: memoryview(v), lambda v: v.reshape(-1), lambda v: v[::2]]
    for keep in keepers:
        kept = keep(buf.array[:3])
        pool.hand_over(buf)
        stop.set()
        with pytest.raises(Stopped):  # at capacity, the only buffer referenced: nothing to hand out
            pool.acquire(stop)
        stop.clear()
        del kept
        assert pool.acquire(stop) is buf


def test_pool_retires_buffers_the_consumer_keeps() -> None:
    """A consumer that keeps more than HOLD_BATCHES batches does not block the reader: the kept
    buffers are given up (never reused) and fresh ones allocated."""
    pool = BatchPool(2, (1,), np.dtype(np.uint8), capacity=HOLD_BATCHES + 1)
    stop = threading.Event()
    kept = []
    for i in range(10):
        buf = pool.acquire(stop)
        buf.array[:] = i
        kept.append(buf.array[:2])
        pool.hand_over(buf)
    assert len(pool) <= HOLD_BATCHES + 1 and pool.retired == pool.allocated - len(pool) > 0
    assert [int(k[0, 0]) for k in kept] == list(range(10))  # nothing kept was overwritten


def _sampler(path: Path, **kw: object) -> TieredSampler:
    return TieredSampler(path, batch_size=4, seed=3, static_cache=0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("ram", ["12records", "40records"])
def test_batches_the_consumer_keeps_are_never_overwritten(tmp_path: Path, ram: str) -> None:
    """Hold every batch of two epochs (numpy views and torch tensors), then compare each with a fresh
    read of its keys: nothing was overwritten although the pool holds only a few buffers."""
    torch = pytest.importorskip("torch")
    n = 37
    ds = make_dataset(tmp_path / "ds", n, shape=SHAPE)
    s = _sampler(ds, ram_size=ram, epochs=2)
    kept = []
    for batch in s:
        kept.append((batch["key"], batch["image"], torch.from_numpy(batch["image"])))
    assert s._pool.retired > 0  # the pool had to give buffers up, not reuse them
    keys = np.concatenate([k for k, _, _ in kept])
    np.testing.assert_array_equal(keys, np.concatenate([epoch_permutation(3, e, n) for e in range(2)]))
    with open_dataset(ds) as fresh:
        for k, image, tensor in kept:
            expect = fresh.read(k)["image"]
            np.testing.assert_array_equal(image, expect)
            np.testing.assert_array_equal(tensor.numpy(), expect)


@pytest.mark.parametrize("cache", [0, "auto"])
def test_a_consumer_that_drops_batches_reuses_the_same_buffers(tmp_path: Path, cache: object) -> None:
    """Batches are views of pool buffers (no copy), and a consumer that drops each batch gets the
    same few buffers back every time: no allocation after the first blocks, none retired."""
    n = 64
    ds = make_dataset(tmp_path / "ds", n, shape=SHAPE)
    s = TieredSampler(ds, batch_size=4, seed=3, ram_size="40records", epochs=4, static_cache=cache)  # type: ignore[arg-type]
    owners = {id(b.owner) for b in s._pool._buffers}
    for batch in s:
        check_batch(batch)
        base = batch["image"].base
        assert base is not None and any(base is b.owner for b in s._pool._buffers)  # a pool buffer itself
        del batch, base
    assert owners <= {id(b.owner) for b in s._pool._buffers}
    for _ in range(3):  # more passes: never more buffers than the plan, none given up
        for batch in s:
            del batch
        assert s._pool.retired == 0 and s._pool.allocated <= s.memory_plan.pool_batches
