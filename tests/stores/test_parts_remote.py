"""Conversions in parts, appends and merges with an object store as the output (issue 22 on issue 11's
stores): a real S3-compatible server (SeaweedFS, tests/helpers/seaweed.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.converters.executors import InlineExecutor
from shardkit.errors import ConversionError
from shardkit.formats import open_dataset, verify
from shardkit.stores import ObjectStore, open_store
from tests.helpers.parts import assert_same_records, class_corpus

OPTIONS = {"size": 16, "records_per_shard": 3}


def _keys(url: str) -> set[str]:
    return {m.key for m in open_store(url).list("")}


def test_parts_into_a_bucket_equal_one_process(s3: Any, tmp_path: Path) -> None:
    src = class_corpus(tmp_path / "corpus", ["landscape", "object"], bad={"object/zero.jpg": ""})
    shardkit.convert(src, tmp_path / "one", workers=1, **OPTIONS)
    url = s3.url("parts")
    s = shardkit.convert(src, url, executor=ThreadPoolExecutor(2), part_size=4, **OPTIONS)
    assert s.output == url and s.parts == 4 and s.parts_converted == 4
    assert_same_records(url, tmp_path / "one")
    assert verify(url).ok
    assert not any(k.startswith(".shardkit-parts/") for k in _keys(url))  # the plan directory is gone
    assert shardkit.convert(src, url, executor=ThreadPoolExecutor(2), part_size=4, **OPTIONS).already_complete


def test_append_in_a_bucket_keeps_readers_on_their_version(s3: Any, tmp_path: Path) -> None:
    whole = class_corpus(tmp_path / "whole", ["landscape", "object", "plant"])
    first = class_corpus(tmp_path / "first", ["landscape", "object"])
    second = class_corpus(tmp_path / "second", ["plant"])
    shardkit.convert(whole, tmp_path / "one", workers=1, **OPTIONS)
    url = s3.url("grown")
    shardkit.convert(first, url, executor=InlineExecutor(), part_size=5, **OPTIONS)
    reader = open_dataset(url)  # version 1, opened before the append; nothing read yet
    n1 = reader.num_records
    with open_dataset(tmp_path / "one") as one:
        v1 = one.payload.read(np.arange(n1)).copy()
    s = shardkit.convert(second, url, append=True, size=16, workers=1, part_size=3)
    assert s.version == 2 and s.commit is not None and s.commit.retired > 0
    assert_same_records(url, tmp_path / "one", roots=(whole, first, second))
    # The last shard of version 1 was replaced in the bucket (larger, new ETag): the old reader reads
    # the copy kept for its version, and its own fields.
    np.testing.assert_array_equal(reader.payload.read(np.arange(n1)), v1)
    assert reader.fields["label"].shape == (n1,)
    with open_dataset(url, version=1) as old:
        np.testing.assert_array_equal(old.read(np.arange(n1))["image"], v1)
    # With a local cache the whole-shard prefetcher finds the replaced shard's new size, leaves it
    # remote, and the ranged path reads this version's copy.
    (tmp_path / "cache").mkdir()
    with open_dataset(url, version=1, cache_dir=tmp_path / "cache") as cached:
        np.testing.assert_array_equal(cached.read(np.arange(n1))["image"], v1)
        np.testing.assert_array_equal(cached.read(np.arange(n1))["image"], v1)
    assert verify(url).ok


def test_refused_append_to_a_bucket_changes_nothing(s3: Any, tmp_path: Path) -> None:
    url = s3.url("refused")
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), url, executor=InlineExecutor(), **OPTIONS)
    store = open_store(url)
    before = {m.key: store.get(m.key) for m in store.list("")}
    with pytest.raises(ConversionError, match="record shape"):
        shardkit.convert(class_corpus(tmp_path / "c2", ["plant"]), url, append=True, size=24, workers=1)
    assert {m.key: store.get(m.key) for m in store.list("")} == before


def test_merge_in_one_bucket_copies_server_side(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 + 6 records in shards of 4: every shard lands on the grid as it is, so the merge copies every
    # shard inside the bucket and downloads or uploads none of them.
    a, b, merged = s3.url("merge-a"), s3.url("merge-b"), s3.url("merged")  # other prefixes of one bucket
    four = {"size": 16, "records_per_shard": 4}
    shardkit.convert(class_corpus(tmp_path / "c1", ["landscape"]), a, executor=InlineExecutor(), **four)
    shardkit.convert(class_corpus(tmp_path / "c2", ["object"]), b, executor=InlineExecutor(), **four)
    shardkit.convert(class_corpus(tmp_path / "c1b", ["landscape"]), tmp_path / "ref", workers=1, **four)
    shardkit.convert(class_corpus(tmp_path / "c2b", ["object"]), tmp_path / "ref", append=True, size=16, workers=1)
    moved: list[str] = []
    real_get, real_put_file = ObjectStore.get, ObjectStore.put_file

    def get(self: ObjectStore, key: str, **kw: Any) -> bytes:
        moved.append(key)
        return real_get(self, key, **kw)

    def put_file(self: ObjectStore, key: str, source: Any, **kw: Any) -> Any:
        moved.append(key)
        return real_put_file(self, key, source, **kw)

    with monkeypatch.context() as patched:
        patched.setattr(ObjectStore, "get", get)
        patched.setattr(ObjectStore, "put_file", put_file)
        report = shardkit.merge([a, b], merged)
    assert report.shards_linked == 4 and report.shards_repacked == 0
    assert not [k for k in moved if "/c/" in k and k.startswith("image/")]  # no payload bytes through here
    assert_same_records(merged, tmp_path / "ref", roots=(tmp_path / "c1", tmp_path / "c2", tmp_path / "c1b",
                                                                  tmp_path / "c2b"))
    assert verify(merged).ok
