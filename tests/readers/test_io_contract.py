"""The I/O contract, proven with an instrumented reader: within every pass over a tier, offsets
ascend per file; each record is read from disk exactly once per epoch; disk bytes per epoch equal the
dataset's payload bytes (plus each shard's index, read once)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats import PayloadArray
from shardkit.formats.reader import Destination
from shardkit.formats.spec import TAIL_SAMPLE_NBYTES, index_nbytes
from shardkit.order.schedule import STAGED_RECORD_BYTES
from shardkit.readers import TieredSampler
from shardkit.readers.options import STAGE_POOL_BATCHES
from tests.helpers.sampler_data import collect, make_dataset

PASS = ("<pass>", -1, 0)


@pytest.fixture
def pass_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mark the start of every read pass in the trace: every read_into() call (read() is one)."""
    real = PayloadArray.read_into

    def marked(self: PayloadArray, keys: np.ndarray, dest: Destination) -> None:
        if self.stats.trace is not None:
            self.stats.trace.append(PASS)
        real(self, keys, dest)

    monkeypatch.setattr(PayloadArray, "read_into", marked)


def _passes(trace: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    out: list[list[tuple[str, int, int]]] = []
    for item in trace:
        if item == PASS:
            out.append([])
        else:
            out[-1].append(item)
    return out


@pytest.mark.parametrize("tiers", ["ram", "ram,ssd"])
def test_ascending_offsets_and_exactly_once(tmp_path: Path, ssd_dir: Path, pass_markers: None, tiers: str) -> None:
    n, rps, epochs = 53, 4, 2
    ds = make_dataset(tmp_path / "ds", n, records_per_shard=rps)
    rec = 16
    s = TieredSampler(ds, tiers=tiers, ram_size="6records", ssd_size="14records", ssd_dir=ssd_dir,
                      batch_size=5, epochs=epochs, seed=4, gap_bytes=0)
    s.stats.disk.trace = []
    s.stats.ssd.trace = []
    keys = np.concatenate(collect(s))
    assert keys.size == epochs * n

    def is_index(f: str, off: int, nb: int) -> bool:
        # A shard's index (S * 16 + 4 bytes, read once per file on first access, with the end of the
        # records it checks against tail_crc32c) sits at its end; with gap_bytes=0 every other
        # request is a whole number of 16-byte records.
        return nb % rec != 0 and (nb - 4) % 16 == 0

    for tier in ("disk", "ssd") if tiers == "ram,ssd" else ("disk",):
        trace = getattr(s.stats, tier).trace
        passes = _passes(trace)
        assert len(passes) > epochs * 3  # many passes: many reservoirs / blocks
        for requests in passes:
            per_file: dict[str, list[tuple[int, int]]] = defaultdict(list)
            for f, off, nb in requests:
                per_file[f].append((off, nb))
            for f, reqs in per_file.items():
                data = [(o, b) for o, b in reqs if not is_index(f, o, b)]
                ends = [o + b for o, b in data]
                assert all(data[i + 1][0] >= ends[i] for i in range(len(data) - 1)), (tier, f, data)
    # Disk: every record's bytes exactly once per epoch, nothing else but each shard index once.
    trace = [t for t in s.stats.disk.trace if t != PASS]
    index = [t for t in trace if is_index(*t)]
    data = [t for t in trace if not is_index(*t)]
    assert len(index) == len({t[0] for t in index}) == -(-n // rps)
    isize = index_nbytes(rps)
    assert all(t[1] + t[2] == os.path.getsize(t[0]) for t in index)
    assert all(t[2] == isize + min(TAIL_SAMPLE_NBYTES, os.path.getsize(t[0]) - isize) for t in index)
    assert sum(t[2] for t in data) == epochs * n * rec  # == dataset payload bytes per epoch
    covered: dict[tuple[str, int], int] = defaultdict(int)
    for f, off, nb in data:
        assert off % rec == 0 and nb % rec == 0
        for r in range(off // rec, (off + nb) // rec):
            covered[(f, r)] += 1
    assert len(covered) == n and set(covered.values()) == {epochs}
    assert s.stats.disk.bytes_read == sum(t[2] for t in trace)


def test_gap_coalescing_reads_small_gaps(tmp_path: Path) -> None:
    """With the default 64 KiB gap, tiny records are read in few large requests (the trade-off)."""
    ds = make_dataset(tmp_path / "ds", 200, records_per_shard=50)
    # 100 records of 16 bytes, the bookkeeping of two blocks of 40 and the staged plan's batches in
    # flight beyond the two held ones: two staging blocks of 40 (no static cache)
    s = TieredSampler(ds, ram_size=100 * 16 + 2 * 40 * STAGED_RECORD_BYTES + (STAGE_POOL_BATCHES - 2) * 10 * 16,
                      static_cache="0", batch_size=10)  # fmt: skip
    assert (s.ram_block, s.memory_plan.static_records, s.memory_plan.staged) == (40, 0, True)
    collect(s)
    blocks = -(-200 // s.ram_block)
    assert s.stats.disk.read_calls == blocks * 4 + 4  # one request per shard per block, + 4 indexes
    assert s.stats.disk.bytes_read > 200 * 16  # the price: gaps were read too
