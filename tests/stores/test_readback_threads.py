"""Runs read back from complete local copies are split between the reading thread and a helper
(issue 32: the tail of a cold epoch and every warm epoch are these reads; docs/design.md §9,
*Reading a copy back*): the records are the written ones, and a helper's error is raised."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import TruncatedShardError
from shardkit.formats import Dataset, ranged
from tests.helpers.sampler_data import check_batch
from tests.helpers.small_parts import N, small_parts_url
from tests.helpers.small_parts import cache_dir as _cache


@pytest.fixture
def warm(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The small-parts dataset with every shard's complete copy in the cache."""
    url = small_parts_url(s3, tmp_path, monkeypatch, "readback")
    with Dataset(url, cache_dir=_cache(tmp_path)) as ds:
        ds.read([0])
        pf = ds.payload.prefetcher  # type: ignore[attr-defined]
        assert all(pf.wait(i) for i in range(len(ds.payload.shards)))
    monkeypatch.setattr(ranged, "READBACK_SPLIT_BYTES", 0)  # split however small the block
    return url


def _reading_threads(monkeypatch: pytest.MonkeyPatch, fail_in: str | None = None) -> list[str]:
    """The thread name of every read from a local copy (raising in threads named ``fail_in...``)."""
    names: list[str] = []
    real = ranged.preadv_exact

    def preadv(fd: int, buffers: Any, offset: int, what: str) -> None:
        name = threading.current_thread().name
        names.append(name)
        if fail_in is not None and name.startswith(fail_in):
            raise TruncatedShardError(f"{what}: cut short (test)")
        real(fd, buffers, offset, what)

    monkeypatch.setattr(ranged, "preadv_exact", preadv)
    return names


def test_a_block_from_complete_copies_is_read_by_two_threads(warm: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    keys = np.random.default_rng(3).permutation(N)
    names = _reading_threads(monkeypatch)
    with Dataset(warm, cache_dir=_cache(tmp_path)) as ds:
        got = ds.read(keys)
        assert ds.payload.prefetcher is None or not any(  # type: ignore[attr-defined]
            ds.payload.prefetcher.pending(i) for i in range(len(ds.payload.shards)))  # type: ignore[attr-defined]
    check_batch({"key": keys, **got})
    helpers = [n for n in names if n.startswith("shardkit-readback")]
    assert helpers and len(helpers) < len(names), names


def test_an_error_in_the_helper_is_raised(warm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _reading_threads(monkeypatch, fail_in="shardkit-readback")
    with Dataset(warm, cache_dir=_cache(tmp_path)) as ds, pytest.raises(TruncatedShardError, match="test"):
        ds.read(np.arange(N))


def test_a_forked_child_starts_helpers_of_its_own(warm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool inherited through fork has no threads: a process whose id differs from the pool's
    maker's starts its own (here the fork is only pretended: the maker's id is changed)."""
    with Dataset(warm, cache_dir=_cache(tmp_path)) as ds:
        ds.read(np.arange(N))
        payload: Any = ds.payload
        inherited = payload._readback
        assert inherited is not None
        payload._readback_pid = -1
        names = _reading_threads(monkeypatch)
        keys = np.arange(N)[::-1]
        got = ds.read(keys)
        assert payload._readback is not inherited
    check_batch({"key": keys, **got})
    assert any(n.startswith("shardkit-readback") for n in names), names
