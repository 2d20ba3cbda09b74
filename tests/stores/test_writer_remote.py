"""``DatasetWriter`` given an object-store URL (#32 item 4): staged in a private local directory,
each shard uploaded as it completes, the metadata last; a failed write leaves no dataset behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, publish, verify
from shardkit.stores import open_store
from shardkit.stores.objectstore import ObjectStore
from tests.helpers.datasets import REPO, make_records

REC = FieldSpec((4, 4), "uint8")


def _writer(path: Any, **kw: Any) -> DatasetWriter:
    return DatasetWriter(path, kind="test", payload="image", record=REC, fields={"label": FieldSpec((), "int64")},
                         labels={"label": ["a", "b", "c"]}, records_per_shard=5, **kw)


def _fill(w: DatasetWriter, recs: np.ndarray) -> None:
    for start in range(0, len(recs), 7):
        w.write({"image": recs[start : start + 7], "label": np.arange(start, min(start + 7, len(recs))) % 3})


def _objects(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {m.key: store.get(m.key) for m in store.list("")}


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_writer_to_a_url_round_trips(s3: Any, tmp_path: Path) -> None:
    recs = make_records(23, (4, 4))
    local = tmp_path / "local"
    with _writer(local) as w:
        _fill(w, recs)
    url = s3.url("written")
    staging = tmp_path / "staging"
    staging.mkdir()
    uploaded_shards: list[str] = []
    with _writer(url, staging_dir=staging, on_shard=lambda s: uploaded_shards.append(s.info.path)) as w:
        _fill(w, recs)
        assert uploaded_shards and open_store(url).exists(uploaded_shards[0]), "a shard is uploaded as it completes"
        with pytest.raises(errors.IncompleteDatasetError):
            open_dataset(url)  # no root document until close
    assert not (Path.cwd() / "s3:").exists()
    assert _objects(url) == _files(local), "the same bytes as a local write"
    assert not any(staging.rglob("*.json")) and not any(p.is_file() for p in staging.rglob("*")), "staging removed"
    assert verify(url).ok
    with open_dataset(url) as ds:
        got = ds.read(np.arange(23))
        np.testing.assert_array_equal(got["image"], recs)
        np.testing.assert_array_equal(got["label"], np.arange(23) % 3)
    with pytest.raises(errors.ConfigError, match="already exists"):
        _writer(url)


def test_failed_url_write_leaves_no_dataset(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3.url("failing")
    original = ObjectStore.put_file
    puts = [0]

    def third_put_fails(self: ObjectStore, key: str, source: Any, **kw: Any) -> Any:
        puts[0] += 1
        if puts[0] == 3:
            raise errors.StoreError(f"{self.describe(key)}: connection reset (injected)")
        return original(self, key, source, **kw)

    monkeypatch.setattr(ObjectStore, "put_file", third_put_fails)
    w = _writer(url, staging_dir=tmp_path)
    with pytest.raises(errors.StoreError, match="failing/image/c/2/0/0"):
        _fill(w, make_records(23, (4, 4)))
    assert puts[0] == 3
    with pytest.raises(errors.DatasetNotFoundError):
        open_dataset(url)  # the two shards uploaded were deleted again
    assert _objects(url) == {}
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_failure_while_publishing_the_metadata_leaves_no_dataset(s3: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3.url("late")
    original = ObjectStore.put_file

    def root_fails(self: ObjectStore, key: str, source: Any, **kw: Any) -> Any:
        if key == "zarr.json":
            raise errors.StoreError(f"{self.describe(key)}: forbidden (injected)")
        return original(self, key, source, **kw)

    monkeypatch.setattr(ObjectStore, "put_file", root_fails)
    with pytest.raises(errors.StoreError, match=r"late/zarr\.json"):
        with _writer(url, staging_dir=tmp_path) as w:
            _fill(w, make_records(12, (4, 4)))
    assert _objects(url) == {}
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_url_writer_refusals(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="read-only"):
        _writer(f"{s3.endpoint}/{s3.bucket}/x", staging_dir=tmp_path)
    with pytest.raises(errors.ConfigError, match="staging_dir"):
        _writer(s3.url("y"), staging_dir=tmp_path / "missing")


def test_file_url_is_a_local_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    recs = make_records(6, (4, 4))
    with _writer(f"file://{tmp_path}/ds") as w:
        _fill(w, recs)
    assert not (tmp_path / "file:").exists()
    with open_dataset(tmp_path / "ds") as ds:
        np.testing.assert_array_equal(ds.read(np.arange(6))["image"], recs)


def test_refused_url_writer_leaves_no_staging(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(errors.SchemaError, match=r"records_per_shard"):
        DatasetWriter(s3.url("bad"), kind="test", payload="image", record=REC, records_per_shard=0 - 1,
                      staging_dir=tmp_path)
    assert not any(p.name.startswith("writer-") for p in tmp_path.rglob("*"))


#: A URL writer that uploads 8 shards, says so on stdout, then waits to be killed with no root document up.
_KILLED_WRITER = """
import sys, time
import numpy as np
from shardkit.formats import DatasetWriter, FieldSpec
w = DatasetWriter(sys.argv[1], kind="test", payload="image", record=FieldSpec((4, 4), "uint8"),
                  fields={"label": FieldSpec((), "int64")}, labels={"label": ["a", "b", "c"]},
                  records_per_shard=5, staging_dir=sys.argv[2])
w.write({"image": np.zeros((41, 4, 4), np.uint8), "label": np.zeros(41, np.int64)})
print("uploaded", flush=True)
time.sleep(600)
"""


def _kill_a_writer_midway(url: str, staging: Path) -> None:
    """Run a URL writer in a process of its own and SIGKILL it once 8 shards are uploaded."""
    staging.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url, str(staging)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "uploaded", child.stderr.read() if child.stderr else line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    assert sum(1 for k in _objects(url) if k.startswith("image/c/")) == 8, "the killed writer left 8 shards"


def test_the_next_url_writer_removes_a_killed_writers_shards(s3: Any, tmp_path: Path) -> None:
    url = s3.url("killed-then-written")
    _kill_a_writer_midway(url, tmp_path / "staging")
    recs = make_records(12, (4, 4))
    local = tmp_path / "local"
    with _writer(local) as w:
        _fill(w, recs)
    with _writer(url, staging_dir=tmp_path / "staging") as w:
        _fill(w, recs)
    assert _objects(url) == _files(local), "exactly the new dataset: no shard that no index names"
    assert verify(url).ok


def test_publish_removes_a_killed_writers_shards(s3: Any, tmp_path: Path) -> None:
    url = s3.url("killed-then-published")
    _kill_a_writer_midway(url, tmp_path / "staging")
    local = tmp_path / "local"
    with _writer(local) as w:
        _fill(w, make_records(12, (4, 4)))
    publish(local, url)
    assert _objects(url) == _files(local)
