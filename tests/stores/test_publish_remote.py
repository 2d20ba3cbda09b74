"""``shardkit publish`` and :func:`shardkit.publish` (#32 item 4): a local dataset uploaded, checked
against its metadata before the root document makes it visible, verified; a different dataset at
the destination refused unless replaced with --overwrite; merge summaries say what really happened."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit import errors
from shardkit.formats import open_dataset
from shardkit.stores import open_store
from shardkit.units import human_bytes
from tests.helpers.cli import run_cli
from tests.helpers.corpora import make_imagefolder
from tests.helpers.datasets import flip_byte, make_records, write_dataset


def _objects(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {m.key: store.get(m.key) for m in store.list("")}


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _records(location: Any) -> np.ndarray:
    with open_dataset(location) as ds:
        return ds.read(np.arange(ds.num_records))["image"]


def test_publish_round_trip(s3: Any, tmp_path: Path) -> None:
    recs = make_records(23)
    local = write_dataset(tmp_path / "ds", recs)
    url = s3.url("published")
    files = _files(local)
    out = run_cli("publish", str(local), url, "-q")
    assert out.returncode == 0, out.stderr
    size = sum(len(b) for b in files.values())
    assert f"uploaded     {len(files)} files, {human_bytes(size)}" in out.stdout, out.stdout
    assert "verified     3 shards" in out.stdout
    assert _objects(url) == files
    np.testing.assert_array_equal(_records(url), recs)
    again = run_cli("publish", str(local), url, "-q", "--verify", "full")
    assert again.returncode == 0 and "already published" in again.stdout, again.stderr


def test_publish_python_api_resumes_and_counts(s3: Any, tmp_path: Path) -> None:
    local = write_dataset(tmp_path / "ds", make_records(12), records_per_shard=5)
    url = s3.url("api")
    store = open_store(url)
    shard = "image/c/0/0/0/0"
    store.put_file(shard, local / shard)  # a foreign copy without shardkit's checksum: uploaded again
    seen: list[int] = []
    report = shardkit.publish(local, url, progress=seen.append)
    files = _files(local)
    assert (report.files, report.nbytes, report.kept) == (len(files), sum(map(len, files.values())), 0)
    assert sum(seen) + len(files[Path("zarr.json").name]) == report.nbytes and report.verified.ok
    assert report.url == store.url and not report.already_published
    assert shardkit.publish(local, url).already_published


def test_publish_refuses_a_different_dataset_unless_overwrite(s3: Any, tmp_path: Path) -> None:
    first = write_dataset(tmp_path / "a", make_records(10, seed=1))
    second = write_dataset(tmp_path / "b", make_records(14, seed=2))
    url = s3.url("taken")
    shardkit.publish(first, url)
    before = _objects(url)
    out = run_cli("publish", str(second), url)
    assert out.returncode == 1 and "--overwrite" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert _objects(url) == before, "nothing uploaded"
    replaced = run_cli("publish", str(second), url, "--overwrite", "-q")
    assert replaced.returncode == 0, replaced.stderr
    assert _objects(url) == _files(second)
    np.testing.assert_array_equal(_records(url), make_records(14, seed=2))


def test_publish_refuses_foreign_objects_and_urls(s3: Any, tmp_path: Path) -> None:
    local = write_dataset(tmp_path / "ds", make_records(5))
    url = s3.url("busy")
    open_store(url).put("notes.txt", b"someone else's")
    with pytest.raises(errors.ConversionError, match="other objects"):
        shardkit.publish(local, url)
    assert _objects(url) == {"notes.txt": b"someone else's"}
    out = run_cli("publish", url, s3.url("elsewhere"))
    assert out.returncode == 1 and "expected a local dataset directory" in out.stderr, out.stderr
    ro = run_cli("publish", str(local), f"{s3.endpoint}/{s3.bucket}/x")
    assert ro.returncode == 1 and "read-only" in ro.stderr, ro.stderr


def test_damaged_source_is_never_published(s3: Any, tmp_path: Path) -> None:
    local = write_dataset(tmp_path / "ds", make_records(23))
    flip_byte(local / "image/c/1/0/0/0", 7)
    url = s3.url("damaged")
    out = run_cli("publish", str(local), url)
    assert out.returncode == 1 and "does not match the metadata" in out.stderr and "image/c/1/0/0/0" in out.stderr, out.stderr
    assert "zarr.json" not in _objects(url)
    with pytest.raises(errors.IncompleteDatasetError):
        open_dataset(url)


def _merge_inputs(tmp_path: Path) -> tuple[Path, Path]:
    return write_dataset(tmp_path / "a", make_records(20, seed=1)), write_dataset(tmp_path / "b", make_records(15, seed=2))


def _shards_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("shards"))


def test_local_merge_says_linked(tmp_path: Path) -> None:
    a, b = _merge_inputs(tmp_path)
    out = run_cli("merge", str(a), str(b), "-o", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    line = _shards_line(out.stdout)
    assert re.search(r"\d+ linked \(.*, no bytes copied\)", line) and "uploaded" not in out.stdout, out.stdout


def test_merge_to_a_url_says_uploaded(s3: Any, tmp_path: Path) -> None:
    a, b = _merge_inputs(tmp_path)
    url = s3.url("merged")
    out = run_cli("merge", str(a), str(b), "-o", url)
    assert out.returncode == 0, out.stderr
    line = _shards_line(out.stdout)
    assert "linked" not in line and re.search(r"\d+ uploaded \(", line), out.stdout
    total = sum(s.nbytes for s in open_dataset(url).meta.shards)
    assert f"uploaded     {human_bytes(total)}" in out.stdout, out.stdout
    within = run_cli("merge", url, url, "-o", s3.url("twice"))  # inside one bucket: server-side copies
    assert within.returncode == 0, within.stderr
    line = _shards_line(within.stdout)
    assert "linked" not in line and re.search(r"\d+ copied by the server \(", line), within.stdout


def test_local_merge_says_copied_where_it_cannot_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _merge_inputs(tmp_path)

    def no_links(src: Any, dst: Any, **kw: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link (injected)")

    monkeypatch.setattr(os, "link", no_links)
    out = run_cli("merge", str(a), str(b), "-o", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    line = _shards_line(out.stdout)
    assert "linked" not in line and re.search(r"\d+ copied \(.*no hard link possible", line), out.stdout
    np.testing.assert_array_equal(_records(tmp_path / "m"), np.concatenate([_records(a), _records(b)]))


def test_convert_to_a_url_says_uploaded(s3: Any, tmp_path: Path) -> None:
    make_imagefolder(tmp_path / "corpus", per_class=3)
    url = s3.url("converted")
    out = run_cli("convert", str(tmp_path / "corpus"), "-o", url, "--size", "16", "-q", "-j", "1",
                  "--staging-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    with open_dataset(url) as ds:
        total = ds.meta.payload_nbytes + sum(d.nbytes for d in ds.meta.files.values())
    assert f"uploaded     {human_bytes(total)}" in out.stdout and "linked" not in out.stdout, out.stdout
    local = run_cli("convert", str(tmp_path / "corpus"), "-o", str(tmp_path / "local"), "--size", "16", "-q", "-j", "1")
    assert local.returncode == 0 and "uploaded" not in local.stdout and "bytes        " in local.stdout, local.stdout
