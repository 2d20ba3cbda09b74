"""Compressed records of a local dataset decode from the mapped shard files (issue 36).

The reading thread copied every run of compressed records into a fresh buffer with ``preadv`` (a
call, an allocation and a copy per run). It now maps each shard once, makes a run's pages resident
once, and the decoders read the records from the page cache itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.errors import TruncatedShardError
from shardkit.formats import Dataset, mapping
from shardkit.formats import reader as reader_module
from tests.helpers.datasets import make_records, write_dataset

RECORDS = make_records(60, shape=(16, 16, 3), seed=7)


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` (still made)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _populating(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the batched calls that make pages resident (not those that announce them)."""
    calls: list[int] = []
    real = mapping._advise

    def counted(m: Any, start: Any, end: Any, advice: int) -> bool:
        if advice == mapping.MADV_POPULATE_READ:
            calls.append(1)
        return real(m, start, end, advice)

    monkeypatch.setattr(mapping, "_advise", counted)
    return calls


@pytest.mark.parametrize("compression", ["zstd", "jpeg:95"])
@pytest.mark.parametrize("workers", [0, 2])
def test_compressed_records_decode_from_the_mapped_files_without_a_read_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str, workers: int
) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=20, compression=compression)
    keys = np.array([41, 3, 57, 18, 22, 9, 35, 50])
    with Dataset(path) as ds:
        payload = ds.payload
        payload.use_decoders(workers)
        expected = payload.read(np.arange(60))  # indexes loaded, every page made resident
        before = payload.stats.bytes_read
        preadv = _counting(monkeypatch, os, "preadv")
        populate = _populating(monkeypatch)
        got = payload.read(keys)
        assert not preadv  # no copy into the reader's memory: the decoders read the mapped pages
        assert not populate  # pages made resident once are not asked for again
        assert payload.stats.bytes_read > before  # still counted as what the read covers
        np.testing.assert_array_equal(got, expected[keys])
        if compression == "zstd":
            np.testing.assert_array_equal(got, RECORDS[keys])


def test_a_first_read_makes_its_runs_resident_in_one_call_per_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=30, compression="zstd")
    with Dataset(path) as ds:
        payload = ds.payload
        payload.gap_bytes = 0  # every record its own run
        payload.index(0), payload.index(1)
        populate = _populating(monkeypatch)
        keys = np.array([1, 5, 9, 13, 33, 40, 52])
        np.testing.assert_array_equal(payload.read(keys), RECORDS[keys])
        assert len(populate) == 2  # one per shard, not one per run


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mapped_shard_is_handed_to_the_decoders_once_however_many_runs_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """A sparse read has several runs a shard; the decoders read a mapped shard's records from its
    pages whatever the runs, so the reading thread hands them over once a shard (a loop turn under
    the GIL per run cost it ~5 µs a record), while its stats still count every run."""
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=30, compression="zstd")
    with Dataset(path) as ds:
        payload = ds.payload
        payload.use_decoders(workers)
        payload.gap_bytes = 0  # every record its own run
        keys = np.array([1, 5, 9, 13, 33, 40, 52])
        payload.read(keys)  # pages made resident
        payload.stats.trace = []
        handed = _counting(monkeypatch, reader_module._DecodeJobs, "add")
        np.testing.assert_array_equal(payload.read(keys), RECORDS[keys])
        assert len(handed) == 2  # one per shard, not one per run
        assert payload.stats.read_calls and [t[1:] for t in payload.stats.trace] == [
            (int(payload.index(k // 30).offsets[k % 30]), int(payload.index(k // 30).nbytes[k % 30])) for k in keys]


def test_a_shard_truncated_under_a_mapping_reader_is_a_named_error(tmp_path: Path) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=60, compression="zstd")
    with Dataset(path) as ds:
        payload = ds.payload
        np.testing.assert_array_equal(payload.read([0, 1]), RECORDS[:2])  # the shard is mapped
        shard = payload.shard_path(0)
        offset = int(payload.index(0).offsets[30])
        os.truncate(shard, offset)  # in place, under the reader: pages past it are gone
        with pytest.raises(TruncatedShardError):
            payload.read([45])


def test_a_reader_that_cannot_map_reads_with_preadv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=20, compression="zstd")
    monkeypatch.setattr(mapping.MappedFile, "open", classmethod(lambda cls, fd, nbytes=0, unit=0: None))
    with Dataset(path) as ds:
        keys = np.array([2, 31, 7, 59])
        assert isinstance(ds.payload, reader_module.PayloadArray)
        preadv = _counting(monkeypatch, os, "preadv")
        np.testing.assert_array_equal(ds.payload.read(keys), RECORDS[keys])
        assert preadv


def test_a_kernel_without_batched_madvise_populates_range_by_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=20, compression="zstd")
    monkeypatch.setattr(mapping, "_batched", [False])  # a kernel without it
    with Dataset(path) as ds:
        keys = np.array([2, 31, 7, 59])
        ds.payload.index(0), ds.payload.index(1), ds.payload.index(2)
        preadv = _counting(monkeypatch, os, "preadv")
        np.testing.assert_array_equal(ds.payload.read(keys), RECORDS[keys])
        assert not preadv  # the pages were made resident one range at a time


def test_a_reader_maps_at_most_max_mapped_files_and_reads_the_other_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=20, compression="zstd")
    monkeypatch.setattr(reader_module, "MAX_MAPPED_FILES", 1)
    with Dataset(path) as ds:
        keys = np.array([2, 31, 7, 59, 44])
        np.testing.assert_array_equal(ds.payload.read(keys), RECORDS[keys])
        mapped = [i for i, got in ds.payload._maps.items() if got is not None]
        assert mapped == [0] and sorted(ds.payload._maps) == [0, 1, 2]


def test_a_plan_announces_with_posix_fadvise_only_the_runs_read_with_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan over a mapped shard and unmapped ones: the mapped shard's runs are announced once, by
    its mapping; the runs read with ``preadv`` are announced with ``posix_fadvise``, and only they."""
    path = write_dataset(tmp_path / "ds", RECORDS, records_per_shard=20, compression="zstd")
    monkeypatch.setattr(reader_module, "MAX_MAPPED_FILES", 1)
    with Dataset(path) as ds:
        payload = ds.payload
        payload.gap_bytes = 0  # every record its own run
        fds = [payload._fd(i) for i in range(3)]
        for i in range(3):
            payload.index(i)
        advised: list[int] = []
        real = os.posix_fadvise

        def spy(fd: int, offset: int, length: int, advice: int) -> None:
            if advice == os.POSIX_FADV_WILLNEED:
                advised.append(fd)
            real(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", spy)
        keys = np.array([2, 7, 31, 35, 44, 59])
        np.testing.assert_array_equal(payload.read(keys), RECORDS[keys])
        assert [i for i, got in payload._maps.items() if got is not None] == [0]
        assert fds[0] not in advised, advised  # mapped: its mapping announced its runs
        assert advised.count(fds[1]) == 2 and advised.count(fds[2]) == 2, advised
