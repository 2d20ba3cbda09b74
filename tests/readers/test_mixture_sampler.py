"""A mixture through the real tier stack (TieredSampler(shardkit.mix(...))): the emitted order is the
mixture's, counts are exact per epoch, reads are ascending per shard of each dataset and once per
occurrence, ranks and resume work as for one dataset, one budget serves all datasets.

Statistical tests use alpha = 1e-3 with fixed seeds.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConfigError, SamplerError
from shardkit.formats import PayloadArray
from shardkit.formats.reader import Destination
from shardkit.ordertest.mixture import run_mixture
from shardkit.readers import TieredSampler
from shardkit.readers.sources import MixedPayload, Mixture
from tests.helpers.order_stats import ALPHA
from tests.helpers.sampler_data import encode, make_dataset

STACKS = {
    "ram": dict(tiers="ram", ram_size="6records"),
    "ram+ssd": dict(tiers="ram,ssd", ram_size="4records", ssd_size="12records"),
}
SIZES = (10, 7, 4)


def _datasets(tmp_path: Path, sizes: tuple[int, ...] = SIZES, rps: int = 3) -> list[Path]:
    first = np.concatenate([[0], np.cumsum(sizes)])
    return [make_dataset(tmp_path / f"d{i}", n, records_per_shard=rps, first=int(first[i])) for i, n in enumerate(sizes)]


def _pairs(sampler: TieredSampler, sizes: tuple[int, ...] = SIZES) -> np.ndarray:
    """Every batch's (dataset, key), each row's payload and fields checked against its dataset."""
    first = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for batch in sampler:
        ds, key = batch["dataset"], batch["key"]
        assert ds.dtype == np.int64 and key.dtype == np.int64
        g = first[ds] + key
        np.testing.assert_array_equal(batch["image"], encode(g))
        np.testing.assert_array_equal(batch["label"], g * 3)
        out.append(np.stack([ds, key], 1))
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("epoch_size", [None, 50, 9])
def test_the_sampler_emits_the_mixture_order(tmp_path: Path, ssd_dir: Path, stack: str, epoch_size: int | None) -> None:
    """Exactly the plan's order, epoch after epoch (L = 21 default, 50: every dataset repeated, 9:
    every dataset sub-sampled), with exact counts, through both stacks."""
    m = shardkit.mix(list(zip(_datasets(tmp_path), [3, 1, 1])), epoch_size=epoch_size)
    s = TieredSampler(m, ssd_dir=ssd_dir, batch_size=4, epochs=3, seed=6, **STACKS[stack])  # type: ignore[arg-type]
    assert s.num_records == m.epoch_size and s.mixture is m
    pairs = _pairs(s).reshape(3, m.epoch_size, 2)
    plan = m.plan(6)
    for e in range(3):
        np.testing.assert_array_equal(pairs[e], plan.pairs(e))
        assert tuple(np.bincount(pairs[e][:, 0], minlength=3)) == m.counts
    assert s.state_dict()["epoch"] == 3 and s.state_dict()["position"] == 0
    assert len(s) == -(-m.epoch_size // 4)


def test_default_options_pass_the_mixture_order_tests(tmp_path: Path) -> None:
    """Seed 0 and every option at its default (besides a small batch): 300 epochs of a 3:1 mixture of
    12 and 5 records pass every test of shardkit order-test for mixtures."""
    a, b = _datasets(tmp_path, (12, 5))
    m = shardkit.mix([(a, 3), (b, 1)])
    with TieredSampler(m, batch_size=8, epochs=300) as s:
        pairs = _pairs(s, (12, 5)).reshape(300, 17, 2)
    report = run_mixture(pairs, sizes=[12, 5], weights=[3, 1], compute_power=False, alpha=ALPHA)
    assert report.passed, report.format()


PASS = ("<pass>", -1, 0)


@pytest.fixture
def pass_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mark the start of every read pass: a block of the mixture (MixedPayload.read_into), or a
    single dataset's read (the SSD tier's reservoirs). The nesting depth is per thread: the SSD
    creator reads from disk while the RAM thread reads a reservoir."""
    local = threading.local()

    def wrap(cls: type, name: str) -> None:
        real = getattr(cls, name)

        def marked(self: object, keys: np.ndarray, dest: Destination) -> None:
            stats = self.stats  # type: ignore[attr-defined]
            depth = getattr(local, "depth", 0)
            if stats.trace is not None and depth == 0:
                stats.trace.append(PASS)
            local.depth = depth + 1
            try:
                real(self, keys, dest)
            finally:
                local.depth = depth

        monkeypatch.setattr(cls, name, marked)

    wrap(PayloadArray, "read_into")
    wrap(MixedPayload, "read_into")


@pytest.mark.parametrize("stack", list(STACKS))
def test_reads_ascend_per_shard_of_each_dataset_once_per_occurrence(
    tmp_path: Path, ssd_dir: Path, pass_markers: None, stack: str
) -> None:
    """Within every read pass, offsets ascend in each shard file of each dataset; every record's bytes
    are read once per occurrence (L = sum of sizes with weights = sizes: each record once per epoch)."""
    paths = _datasets(tmp_path, rps=4)
    m = shardkit.mix(list(zip(paths, SIZES)))
    s = TieredSampler(m, ssd_dir=ssd_dir, batch_size=5, epochs=2, seed=2, gap_bytes=0, **STACKS[stack])  # type: ignore[arg-type]
    s.stats.disk.trace = []
    pairs = _pairs(s)
    assert pairs.shape[0] == 2 * sum(SIZES)
    rec = 16
    trace = s.stats.disk.trace
    passes: list[list[tuple[str, int, int]]] = []
    for item in trace:
        if item == PASS:
            passes.append([])
        elif passes:
            passes[-1].append(item)
    assert len(passes) > 4
    if stack == "ram":
        assert len(passes) < pairs.shape[0] / 2  # a pass per block, not per record
    for requests in passes:
        per_file: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for f, off, nb in requests:
            if nb % rec == 0:  # payload requests (a shard's index is 4 * 16 + 4 bytes)
                per_file[f].append((off, nb))
        for f, reqs in per_file.items():
            assert all(reqs[i + 1][0] >= reqs[i][0] + reqs[i][1] for i in range(len(reqs) - 1)), (f, reqs)
    data = [t for t in trace if t != PASS and t[2] % rec == 0]
    files = {t[0] for t in data}
    owners = {next(os.fspath(p) for p in paths if f.startswith(os.fspath(p) + os.sep)) for f in files}
    assert owners == {os.fspath(p) for p in paths}  # every dataset read, nothing outside them
    assert sum(t[2] for t in data) == 2 * sum(SIZES) * rec  # each record once per epoch, nothing twice


def test_repeated_records_are_read_at_most_once_per_occurrence(tmp_path: Path) -> None:
    """n_i > N_i: dataset 2 (4 records) appears 5 times over per epoch; disk reads stay at or below one
    per occurrence, and RAM blocks holding a record twice read it once."""
    paths = _datasets(tmp_path)
    m = shardkit.mix([(paths[0], 1), (paths[1], 1), (paths[2], 2)], epoch_size=80)
    assert m.counts == (20, 20, 40)
    s = TieredSampler(m, tiers="ram", ram_size="40records", batch_size=8, epochs=2, seed=1, static_cache=0)
    pairs = _pairs(s)
    assert pairs.shape[0] == 160
    _first, largest = s.block_schedule
    assert largest >= 8
    # Epoch 1 (shard indexes were read in epoch 0): blocks of 8 records hold repeats of dataset 2's
    # 4 records (40 of the 80 slots), each read once per block: fewer bytes than one read per slot.
    assert s.stats.disk_bytes_by_epoch[1] < 80 * 16


@pytest.mark.parametrize("stop_after", [1, 3, 7])
def test_resume_equals_uninterrupted_also_with_another_world_size(tmp_path: Path, stop_after: int) -> None:
    m = shardkit.mix(list(zip(_datasets(tmp_path), [2, 1, 1])), epoch_size=30)
    full = _pairs(TieredSampler(m, tiers="ram", ram_size="6records", batch_size=3, epochs=2, seed=9))
    first = TieredSampler(m, tiers="ram", ram_size="6records", batch_size=3, epochs=2, seed=9)
    got = []
    for i, batch in enumerate(first):
        got.append(np.stack([batch["dataset"], batch["key"]], 1))
        if i + 1 == stop_after:
            break
    state = first.state_dict()
    first.close()
    # Continue with two ranks (global batches of 2 x 3): their slices, ordered by (epoch, position
    # after the global batch, rank), make up the same order.
    rest: list[tuple[int, int, int, np.ndarray]] = []
    for r in range(2):
        s = TieredSampler(m, tiers="ram", ram_size="6records", batch_size=3, epochs=2, seed=9, rank=r, world_size=2)
        s.load_state_dict(state)
        for batch in s:
            rest.append((s.epoch, s.position, r, np.stack([batch["dataset"], batch["key"]], 1)))
    merged = [x[3] for x in sorted(rest, key=lambda x: x[:3])]
    resumed = np.concatenate(got + merged)
    np.testing.assert_array_equal(resumed, full)


def test_ranks_take_disjoint_slots_whose_union_is_the_epoch(tmp_path: Path) -> None:
    m = shardkit.mix(list(zip(_datasets(tmp_path), [3, 2, 1])), epoch_size=31)
    full = _pairs(TieredSampler(m, tiers="ram", ram_size="8records", batch_size=2, epochs=1, seed=4))
    parts: list[tuple[int, int, np.ndarray]] = []
    for r in range(3):
        s = TieredSampler(m, tiers="ram", ram_size="8records", batch_size=2, epochs=1, seed=4, rank=r, world_size=3)
        parts += [(s.position, r, np.stack([b["dataset"], b["key"]], 1)) for b in s]
    np.testing.assert_array_equal(np.concatenate([p[2] for p in sorted(parts, key=lambda p: p[:2])]), full)


def test_state_of_another_mixture_is_refused(tmp_path: Path) -> None:
    paths = _datasets(tmp_path)
    a = TieredSampler(shardkit.mix(list(zip(paths, [3, 1, 1]))), batch_size=4, seed=1)
    b = TieredSampler(shardkit.mix(list(zip(paths, [1, 1, 1]))), batch_size=4, seed=1)
    with pytest.raises(SamplerError, match="mixture"):
        b.load_state_dict(a.state_dict())
    single = TieredSampler(paths[0], batch_size=4, seed=1)
    with pytest.raises(SamplerError):
        single.load_state_dict(a.state_dict())


def test_mixture_options(tmp_path: Path) -> None:
    paths = _datasets(tmp_path)
    m = shardkit.mix(list(zip(paths, [1, 1, 1])), seed=5)
    assert TieredSampler(m).seed == 5  # the mixture's own seed
    assert TieredSampler(m, seed=5).seed == 5
    with pytest.raises(ConfigError, match="seed: the mixture was made with seed=5"):
        TieredSampler(m, seed=4)
    with pytest.raises(ConfigError, match="mode: a mixture is sampled in 'epoch' mode"):
        TieredSampler(shardkit.mix(list(zip(paths, [1, 1, 1]))), mode="sequential")
    assert isinstance(m, Mixture)


@pytest.mark.parametrize("cut", [1, 5, 13, 29])
def test_resume_inside_a_batch(tmp_path: Path, cut: int) -> None:
    """A run stopped after any number of records (``limit``) resumes at exactly that slot."""
    m = shardkit.mix(list(zip(_datasets(tmp_path), [1, 2, 1])), epoch_size=24)
    full = _pairs(TieredSampler(m, tiers="ram", ram_size="6records", batch_size=4, epochs=2, seed=3))
    first = TieredSampler(m, tiers="ram", ram_size="6records", batch_size=4, epochs=2, seed=3, limit=cut)
    head = _pairs(first)
    assert head.shape[0] == cut
    rest = TieredSampler(m, tiers="ram", ram_size="6records", batch_size=4, epochs=2, seed=3)
    rest.load_state_dict(first.state_dict())
    tail = _pairs(rest)
    np.testing.assert_array_equal(np.concatenate([head, tail])[: full.shape[0]], full)


def test_one_budget_caches_the_whole_mixture(tmp_path: Path) -> None:
    """A RAM budget that holds every record of every dataset caches them all: after the first epoch
    nothing is read from storage, and the order is unchanged."""
    m = shardkit.mix(list(zip(_datasets(tmp_path), [1, 1, 1])), epoch_size=40)
    s = TieredSampler(m, tiers="ram", ram_size="200records", batch_size=4, epochs=3, seed=8)
    assert s.cache_fraction == 1.0 and s.static_cache == sum(SIZES)
    pairs = _pairs(s).reshape(3, 40, 2)
    for e in range(3):
        np.testing.assert_array_equal(pairs[e], m.plan(8).pairs(e))
    by_epoch = s.stats.disk_bytes_by_epoch
    assert by_epoch[0] > 0 and by_epoch.get(1, 0) == 0 and by_epoch.get(2, 0) == 0


def test_a_static_cache_pins_global_keys(tmp_path: Path) -> None:
    """A static cache of 9 records pins 9 of the 21 global keys; with weights equal to the sizes every
    record occurs once per epoch, so epoch 1 reads exactly the 12 others."""
    m = shardkit.mix(list(zip(_datasets(tmp_path), SIZES)))
    s = TieredSampler(m, tiers="ram", ram_size="40records", static_cache="9records", batch_size=4, epochs=2, seed=8,
                      gap_bytes=0)
    keys = s.pinned_keys
    assert keys.size == 9 and keys.min() >= 0 and keys.max() < sum(SIZES)
    pairs = _pairs(s).reshape(2, sum(SIZES), 2)
    np.testing.assert_array_equal(pairs[1], m.plan(8).pairs(1))
    assert s.stats.disk_bytes_by_epoch[1] == (sum(SIZES) - 9) * 16


def test_locality_is_refused_for_a_mixture(tmp_path: Path) -> None:
    """The node partition is drawn over one dataset's keys: a mixture with locality is a clear error."""
    m = shardkit.mix(list(zip(_datasets(tmp_path), [1, 1, 1])))
    with pytest.raises(ConfigError, match="locality: not available for a mixture"):
        TieredSampler(m, batch_size=4, locality=True, nodes=1)
