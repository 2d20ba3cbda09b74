"""``shardkit convert SRC -o s3://...``: staged locally, shards uploaded as they complete, metadata
last; killed after any upload, the same command resumes to a byte-identical dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.errors import ConversionError, IncompleteDatasetError
from shardkit.formats import open_dataset, verify
from shardkit.stores import open_store
from tests.helpers.corpora import make_imagefolder

REPO = Path(__file__).resolve().parents[2]
OPTIONS = {"size": 16, "records_per_shard": 3, "workers": 1}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    make_imagefolder(root, per_class=4, bad=True)
    return root


def _objects(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {m.key: store.get(m.key) for m in store.list("")}


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_convert_to_bucket_equals_local(s3: Any, corpus: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    shardkit.convert(corpus, local, **OPTIONS)
    url = s3.url("ds")
    staging = tmp_path / "staging"
    staging.mkdir()
    summary = shardkit.convert(corpus, url, staging_dir=staging, **OPTIONS)
    assert summary.output == url and summary.records == open_dataset(local).num_records
    assert _objects(url) == _files(local)  # every object byte-identical to the local conversion
    assert verify(url).ok
    assert not any(staging.rglob("*.json")), "the staging directory is removed after the upload"
    with open_dataset(url) as ds, open_dataset(local) as ref:
        keys = np.arange(ref.num_records)
        np.testing.assert_array_equal(ds.payload.read(keys), ref.payload.read(keys))
    again = shardkit.convert(corpus, url, staging_dir=staging, **OPTIONS)
    assert again.already_complete
    with pytest.raises(ConversionError, match="different parameters"):
        shardkit.convert(corpus, url, staging_dir=staging, **{**OPTIONS, "size": 8})
    replaced = shardkit.convert(corpus, url, staging_dir=staging, overwrite=True, **{**OPTIONS, "size": 8})
    assert replaced.records == summary.records and open_dataset(url).meta.record.shape[0] == 8


def test_cli_convert_to_url(s3: Any, corpus: Path, tmp_path: Path) -> None:
    url = s3.url("cli")
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "convert", str(corpus), "-o", url, "--size", "16", "-q", "-j", "1",
         "--staging-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert f"to {url}" in out.stdout
    info = subprocess.run([sys.executable, "-m", "shardkit", "info", url, "--json"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert info.returncode == 0 and json.loads(info.stdout)["kind"] == "imagefolder"


def test_refuses_foreign_prefix_and_read_only_stores(s3: Any, corpus: Path, tmp_path: Path) -> None:
    url = s3.url("busy")
    open_store(url).put("notes.txt", b"someone else's")
    with pytest.raises(ConversionError, match="not a shardkit dataset"):
        shardkit.convert(corpus, url, staging_dir=tmp_path, **OPTIONS)
    with pytest.raises(ConversionError, match="refusing to overwrite"):
        shardkit.convert(corpus, url, staging_dir=tmp_path, overwrite=True, **OPTIONS)
    assert open_store(url).get("notes.txt") == b"someone else's"
    with pytest.raises(ConversionError, match="read-only"):
        shardkit.convert(corpus, f"{s3.endpoint}/{s3.bucket}/x", staging_dir=tmp_path, **OPTIONS)


_KILLER = """
import json, os, sys
from shardkit.stores import objectstore
spec = json.loads(sys.argv[1])
left = [spec["after"]]
for name in ("put", "put_file"):
    original = getattr(objectstore.ObjectStore, name)
    def wrapped(self, *a, _original=original, **kw):
        result = _original(self, *a, **kw)
        left[0] -= 1
        if left[0] == 0:
            os._exit(9)  # killed right after this upload, as by SIGKILL: nothing is cleaned up
        return result
    setattr(objectstore.ObjectStore, name, wrapped)
import shardkit
shardkit.convert(spec["src"], spec["url"], staging_dir=spec["staging"], **spec["options"])
"""


def test_killed_after_any_upload_resumes_byte_identical(s3: Any, corpus: Path, tmp_path: Path) -> None:
    """Killed right after each upload in turn (shards, fields, documents, the root document): the
    same command finishes the job, and the bucket holds exactly the uninterrupted conversion."""
    local = tmp_path / "local"
    shardkit.convert(corpus, local, **OPTIONS)
    reference = _files(local)
    uploads = len(reference)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for after in range(1, uploads + 1):
        url = s3.url(f"kill{after}")
        staging = tmp_path / f"staging{after}"
        staging.mkdir()
        spec = json.dumps({"src": str(corpus), "url": url, "staging": str(staging), "after": after, "options": OPTIONS})
        run = subprocess.run([sys.executable, "-c", _KILLER, spec], capture_output=True, text=True, timeout=300,
                             env=env, check=False)
        assert run.returncode == 9, (after, run.stderr[-2000:])
        if after < uploads:
            with pytest.raises(IncompleteDatasetError):
                open_dataset(url)  # the root document goes last: never a partial dataset
        shardkit.convert(corpus, url, staging_dir=staging, **OPTIONS)
        assert _objects(url) == reference, f"killed after upload {after}"
        assert not any(p.is_file() for p in staging.rglob("*")), "nothing staged is left behind"
