"""Reading complete cache copies back (a warm epoch, a cold epoch's blocks after the download): the
local reader's engine on the copies, no download started, gaps of any width (docs/design.md §9)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.formats import Dataset
from shardkit.formats import reader as reader_mod
from tests.helpers.sampler_data import check_batch
from tests.helpers.small_parts import PER_SHARD, SHAPE, N, small_parts_url
from tests.helpers.small_parts import cache_dir as _cache

SPARSE = [1, 2, 12, 30, PER_SHARD + 5, PER_SHARD + 6, 2 * PER_SHARD + 39]  # runs of one and two records


@pytest.fixture
def url(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return small_parts_url(s3, tmp_path, monkeypatch, "readback")


def _fill(url: str, cache: Path) -> None:
    """Download every shard into ``cache`` and wait until each copy is complete."""
    with Dataset(url, cache_dir=cache) as ds:
        check_batch({"key": np.arange(N), **ds.read(np.arange(N))})
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        assert all(pf.wait(i) for i in range(N // PER_SHARD))


def test_a_read_of_complete_copies_starts_no_download(url: str, tmp_path: Path) -> None:
    """Every copy complete: the read makes no request and starts no fetch threads."""
    _fill(url, _cache(tmp_path))
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        calls = ds.payload.stats.read_calls
        check_batch({"key": np.array(SPARSE), **ds.read(SPARSE)})
        assert ds.payload.prefetcher is None  # type: ignore[attr-defined]
        assert ds.payload.stats.read_calls == calls
        assert ds.payload.cache_stats.bytes_read >= len(SPARSE) * int(np.prod(SHAPE))  # type: ignore[attr-defined]


def test_complete_copies_are_read_as_local_shard_files(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse read of complete copies goes through the local reader: every run announced to the
    kernel (``POSIX_FADV_WILLNEED`` on the copy) before it is read, as for a local dataset."""
    _fill(url, _cache(tmp_path))
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(reader_mod.os, "posix_fadvise", fadvise)
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        check_batch({"key": np.array(SPARSE), **ds.read(SPARSE)})
    rec = int(np.prod(SHAPE))
    assert advised == [(1 * rec, 2 * rec), (12 * rec, rec), (30 * rec, rec), (5 * rec, 2 * rec),
                       (39 * rec, rec)]


def test_gaps_wider_than_the_local_default_are_read_from_a_copy(url: str, tmp_path: Path) -> None:
    """``remote_gap_bytes`` above the local default: a run's gaps read from the copy are dropped,
    its records land in their rows."""
    _fill(url, _cache(tmp_path))
    rec = int(np.prod(SHAPE))
    keys = np.array([0, 9, 18, PER_SHARD + 1, PER_SHARD + 30])  # gaps of 8 and 28 records (128, 448 KiB)
    assert 28 * rec > reader_mod.DEFAULT_GAP_BYTES
    with Dataset(url, cache_dir=_cache(tmp_path), remote_gap_bytes=32 * rec) as ds:
        check_batch({"key": keys, **ds.read(keys)})

