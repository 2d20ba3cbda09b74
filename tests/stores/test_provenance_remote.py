"""Provenance and ``show`` of a dataset in an object store: the same sources and sheet as the local copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

import shardkit
from shardkit.formats import open_dataset
from tests.helpers.corpora import make_imagefolder


def test_sources_and_show_of_a_bucket_dataset_equal_the_local_ones(s3: Any, tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    make_imagefolder(root, per_class=3, bad=True)
    local, url = tmp_path / "local", s3.url("prov")
    shardkit.convert(root, local, size=16, workers=1)
    staging = tmp_path / "staging"
    staging.mkdir()
    shardkit.convert(root, url, size=16, workers=1, staging_dir=staging)
    with open_dataset(url) as remote, open_dataset(local) as ref:
        assert remote.provenance is not None and remote.provenance.changes == ref.provenance.changes
        for k in range(len(ref)):
            assert remote.source(k) == ref.source(k)
    a = shardkit.show(url, tmp_path / "remote.png", keys=[0, 3])
    b = shardkit.show(local, tmp_path / "local.png", keys=[0, 3])
    np.testing.assert_array_equal(np.asarray(Image.open(a.path)), np.asarray(Image.open(b.path)))
    assert shardkit.export(url, tmp_path / "x", keys=[2])[0].name.startswith("000002-")
