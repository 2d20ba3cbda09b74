"""The exact order's head (issue 34): on a large dataset the first positions of ``pi`` are drawn on
their own, so the first batch does not wait for an O(N) shuffle.

``pi[:k]`` is a uniform ordered sample without replacement and ``pi[k:]`` a uniform permutation of the
other keys, so ``pi`` stays exactly uniform: checked on the joint law of whole permutations (every
one of the 4! orders of 4 records, head of 2) and with the suite's item x position chi-square. Up to
``HEAD_THRESHOLD`` records the order is numpy's permutation, unchanged. The sampler serves its first
batch from the head while the whole order is still being drawn (forced: the draw waits for an event).

Statistical tests use alpha = 1e-3 and fixed seeds.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from shardkit.order import schedule
from shardkit.order.schedule import EpochOrder, HeadFirstOrder, head_keys, head_size
from shardkit.order.seeds import Domain, rng
from shardkit.readers import TieredSampler, epoch_permutation
from tests.helpers.order_stats import ALPHA, item_position_pvalue
from tests.helpers.sampler_data import check_batch, make_dataset


def test_small_orders_are_numpys_permutation_and_large_ones_start_with_their_head() -> None:
    n = schedule.HEAD_THRESHOLD
    assert head_size(n) == 0 and head_size(n + 1) == schedule.HEAD_RECORDS
    np.testing.assert_array_equal(epoch_permutation(3, 1, 1000), rng(Domain.EPOCH_ORDER, 3, 1).permutation(1000))
    for n, k in [(10, 3), (100, 40), (1000, 999), (7, 1), (5000, 2000)]:
        pi = epoch_permutation(3, 1, n, head=k)
        np.testing.assert_array_equal(np.sort(pi), np.arange(n))
        np.testing.assert_array_equal(head_keys(3, 1, n, head=k), pi[:k])
    # A head of every position is no head at all.
    np.testing.assert_array_equal(epoch_permutation(3, 1, 9, head=9), epoch_permutation(3, 1, 9))
    assert head_keys(3, 1, 9, head=9).size == 0


def test_an_order_with_a_head_is_exactly_uniform() -> None:
    # The joint law: each of the 24 orders of 4 records equally likely (head of 2).
    epochs = 4800
    perms = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(len(perms))
    for e in range(epochs):
        counts[perms[tuple(int(x) for x in epoch_permutation(7, e, 4, head=2))]] += 1
    assert stats.chisquare(counts).pvalue > ALPHA
    # Item x position, 12 records, head of 5.
    orders = np.stack([epoch_permutation(11, e, 12, head=5) for e in range(3000)])
    assert item_position_pvalue(orders) > ALPHA


def test_the_head_order_answers_the_head_before_the_whole_order() -> None:
    n, k = 40, 8
    drawn = threading.Event()
    pi = epoch_permutation(2, 0, n, head=k)

    def whole() -> tuple[EpochOrder, None]:
        assert drawn.wait(60)
        return schedule.ArrayOrder(pi), None

    order = HeadFirstOrder(head_keys(2, 0, n, head=k), n, whole)
    np.testing.assert_array_equal(order.keys(np.arange(k)), pi[:k])
    assert not order.drawn
    drawn.set()
    np.testing.assert_array_equal(order.keys(np.arange(n)), pi)
    assert order.drawn and order.keys(np.empty(0, dtype=np.int64)).size == 0
    order.release()


@pytest.mark.parametrize("node_sharing", [True, False])
def test_first_batch_arrives_while_the_whole_order_is_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_sharing: bool
) -> None:
    """A dataset above the (lowered) threshold: the first batch comes while drawing the whole order
    is held up, and the epoch is exactly ``epoch_permutation``."""
    n = 30
    monkeypatch.setattr(schedule, "HEAD_THRESHOLD", 16)
    monkeypatch.setattr(schedule, "HEAD_RECORDS", 8)
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 1)  # first block: one batch
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5)
    go, asked = threading.Event(), []
    real = TieredSampler._slot_order

    def held(self: TieredSampler, epoch: int) -> tuple[EpochOrder, object]:
        asked.append(epoch)
        assert go.wait(60), "the first batch waited for the whole order"
        return real(self, epoch)

    monkeypatch.setattr(TieredSampler, "_slot_order", held)
    s = TieredSampler(ds, batch_size=2, epochs=1, seed=5, ram_size="4records", node_sharing=node_sharing)
    run = iter(s)
    first = check_batch(next(run))
    assert asked == [0] and not go.is_set()
    go.set()
    keys = np.concatenate([first, *(check_batch(b) for b in run)])
    np.testing.assert_array_equal(keys, epoch_permutation(5, 0, n))
    assert epoch_permutation(5, 0, n)[:8].tolist() == head_keys(5, 0, n).tolist()
    s.close()


@pytest.mark.parametrize("node_sharing", [True, False])
def test_close_during_the_background_draw_stops_the_run_without_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_sharing: bool
) -> None:
    """The whole order is one numpy shuffle (10 s of CPU at 10^8 records) that cannot be interrupted:
    close() while the reader waits for it stops the run's threads without waiting for the draw
    (forced: the draw is held until after close), and the drawing thread lets go of the order once
    its draw ends."""
    n = 30
    monkeypatch.setattr(schedule, "HEAD_THRESHOLD", 16)
    monkeypatch.setattr(schedule, "HEAD_RECORDS", 8)
    monkeypatch.setattr(schedule, "FIRST_BLOCK_BYTES", 1)
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=5)
    go, waiting, released = threading.Event(), threading.Event(), threading.Event()
    real_slot_order, real_whole = TieredSampler._slot_order, HeadFirstOrder.whole

    def held(self: TieredSampler, epoch: int) -> tuple[EpochOrder, object]:
        assert go.wait(60)
        order, release = real_slot_order(self, epoch)

        def counted() -> None:
            released.set()
            if release is not None:
                release()

        return order, counted

    def whole(self: HeadFirstOrder) -> EpochOrder:
        waiting.set()  # the reader asks for a key beyond the head
        return real_whole(self)

    monkeypatch.setattr(TieredSampler, "_slot_order", held)
    monkeypatch.setattr(HeadFirstOrder, "whole", whole)
    before = set(threading.enumerate())
    s = TieredSampler(ds, batch_size=2, epochs=1, seed=5, ram_size="4records", node_sharing=node_sharing)
    run = iter(s)
    check_batch(next(run))
    assert waiting.wait(60)
    run_threads = [t for t in set(threading.enumerate()) - before if t.name != "shardkit-order"]
    assert run_threads
    s.close()
    assert not go.is_set() and not [t.name for t in run_threads if t.is_alive()]
    assert not released.is_set()
    go.set()
    assert released.wait(60), "the order drawn after close was not let go"


def test_drawing_a_head_with_repeats_does_not_import_numpy_ma() -> None:
    """The head's draw finds its repeated values by a sort (``distinct_sorted``), not ``np.unique``,
    whose first call imports ``numpy.ma``: a fifth of a second in a fresh sampler's first epoch.
    Checked in a fresh interpreter, where nothing else imported it yet."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r})\n"
        "from shardkit.order.schedule import head_keys\n"
        "assert 'numpy.ma' not in sys.modules\n"
        "keys = head_keys(1, 0, 1000, head=900)\n"  # 900 of 1,000 values: the stream repeats many
        "assert sorted(set(keys.tolist())) == sorted(keys.tolist()) and keys.size == 900\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
