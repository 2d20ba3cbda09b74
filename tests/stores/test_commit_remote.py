"""Two commits planned on one version of a dataset in an object store (#35): there is no ``flock`` there,
so the version is claimed with a put made only if absent before anything is written; the interleavings
are forced by running the second commit inside the first one's claim (no sleeping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConversionError
from shardkit.formats import Dataset, DatasetWriter, FieldSpec, open_dataset, verify
from shardkit.formats import commit as commit_module
from shardkit.formats.commit import Segment, StoredShard, claim_key, commit
from shardkit.stores import open_store
from tests.helpers.datasets import make_records

S = 10


def _write(path: Path, records: np.ndarray) -> Dataset:
    with DatasetWriter(path, kind="test", payload="image", record=FieldSpec(records.shape[1:], "uint8"),
                       fields={"label": FieldSpec((), "int64")}, labels={"label": ["a", "b", "c"]},
                       records_per_shard=S) as w:
        w.write({"image": records, "label": np.arange(len(records)) % 3})
    return open_dataset(path)


def _segment(ds: Dataset) -> Segment:
    shards = tuple(StoredShard.of(ds.store, s, ds.meta.records_per_shard) for s in ds.meta.shards)
    return Segment(ds.num_records, shards, lambda: ds.fields, ds.meta.labels, tuple(ds.meta.skipped))


def _setup(s3: Any, tmp_path: Path) -> tuple[str, Dataset, Dataset, Dataset, np.ndarray]:
    records = make_records(40)
    _write(tmp_path / "base", records[:15]).close()
    url = s3.url("ds")
    shardkit.publish(tmp_path / "base", url)
    base = open_dataset(url)
    return url, base, _write(tmp_path / "a", records[15:27]), _write(tmp_path / "b", records[27:]), records


def _append(url: str, base: Dataset, more: Dataset, plan: str) -> Any:
    return commit(url, base.meta, [_segment(more)], base=base.meta, plan=plan, history={"operation": "append"})


def _objects(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {m.key: store.get(m.key) for m in store.list("")}


def test_a_commit_that_finds_the_version_claimed_changes_nothing(s3: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url, base, a, b, records = _setup(s3, tmp_path)
    real = commit_module._claim_version
    seen: dict[str, Any] = {}

    def claim_then_b_runs(store: Any, number: int, plan: str) -> None:
        real(store, number, plan)
        if plan == "A":  # A holds version 2: B, planned on version 1 too, runs to its end now
            assert store.exists(claim_key(2))
            before = _objects(url)
            with pytest.raises(ConversionError, match=r"claim-v000002\.json: another commit \(plan A\) holds version 2"):
                _append(url, base, b, "B")
            seen["unchanged"] = _objects(url) == before

    monkeypatch.setattr(commit_module, "_claim_version", claim_then_b_runs)
    report = _append(url, base, a, "A")
    assert seen["unchanged"] and report.version == 2
    with open_dataset(url) as ds:
        np.testing.assert_array_equal(ds.read(np.arange(27))["image"], records[:27])
    assert verify(url).ok and not open_store(url).exists(claim_key(2))  # released once published


def test_a_commit_that_claims_after_another_published_is_refused(s3: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url, base, a, b, records = _setup(s3, tmp_path)
    real = commit_module._claim_version

    def b_finishes_first(store: Any, number: int, plan: str) -> None:
        if plan == "A":  # before A claims, B commits version 2 whole and releases its claim
            _append(url, base, b, "B")
            assert not store.exists(claim_key(2))
        real(store, number, plan)

    monkeypatch.setattr(commit_module, "_claim_version", b_finishes_first)
    with pytest.raises(ConversionError, match="the dataset is at version 2, but this commit was planned on version 1"):
        _append(url, base, a, "A")
    assert not open_store(url).exists(claim_key(2))  # A let its claim go
    with open_dataset(url) as ds:
        assert ds.num_records == 15 + 13
        np.testing.assert_array_equal(ds.read(np.arange(28))["image"], np.concatenate([records[:15], records[27:]]))
    assert verify(url).ok


def test_a_claim_left_by_a_killed_commit_lets_its_own_rerun_finish(s3: Any, tmp_path: Path) -> None:
    url, base, a, b, records = _setup(s3, tmp_path)
    commit_module._claim_version(open_store(url), 2, "A")  # a run of plan A killed right after claiming
    with pytest.raises(ConversionError, match=r"another commit \(plan A\) holds version 2.*delete this object"):
        _append(url, base, b, "B")
    assert _append(url, base, a, "A").version == 2  # the same command again finishes it
    assert not open_store(url).exists(claim_key(2))
    with open_dataset(url) as ds:
        np.testing.assert_array_equal(ds.read(np.arange(27))["image"], records[:27])
