"""Every path taken from metadata stays inside the dataset directory (issue 10 item 7)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit import errors
from shardkit.formats import DatasetWriter, FieldSpec, open_dataset, verify
from tests.helpers.datasets import edit_attributes, make_records, write_dataset


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "ds", make_records(25), records_per_shard=10)


def _outside(tmp_path: Path) -> Path:
    """A directory outside the dataset holding a copy of what an attacker wants read instead."""
    out = tmp_path / "elsewhere"
    out.mkdir(exist_ok=True)
    return out


@pytest.mark.parametrize("bad", ["../../x", "/etc/passwd", "image/c/0/../../../x", "image/c/0/0/0/../../../../../x"])
def test_shard_path_outside_the_dataset_is_refused(dataset: Path, bad: str) -> None:
    edit_attributes(dataset, lambda a: a["shards"][0].__setitem__("path", bad))
    with pytest.raises(errors.UnsafePathError, match="shard 0 path"):
        open_dataset(dataset)
    with pytest.raises(errors.UnsafePathError):
        verify(dataset)


def test_shard_path_must_be_the_chunk_key(dataset: Path) -> None:
    # Inside the dataset but not where zarr would look: zarr-python and shardkit must read the same file.
    edit_attributes(dataset, lambda a: a["shards"][1].__setitem__("path", "image/c/0/0/0/0"))
    with pytest.raises(errors.NotADatasetError, match="not the array's chunk key 'image/c/1/0/0/0'"):
        open_dataset(dataset)


@pytest.mark.parametrize("key,bad", [
    ("payload", "../image"), ("payload", "/etc"), ("payload", "."), ("payload", ".shardkit-staging"),
    ("payload", "a/b"), ("payload", "zarr.json"), ("field", ".."), ("field", "/etc"), ("field", "x\\..\\y"),
    ("field", "lab\x00el"), ("field", ""),
])
def test_unsafe_array_and_field_names_are_refused(dataset: Path, key: str, bad: str) -> None:
    def edit(a: dict[str, Any]) -> None:
        if key == "payload":
            a["payload"] = bad
        else:
            a["fields"][bad] = a["fields"].pop("label")

    edit_attributes(dataset, edit)
    with pytest.raises(errors.UnsafePathError, match="not a plain name"):
        open_dataset(dataset)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_field_directory_symlinked_outside_is_refused(tmp_path: Path, version: str) -> None:
    # The attacker's copy of a valid field array lives outside; the field dir is a symlink to it.
    dataset = tmp_path / "ds"
    shutil.copytree(Path(__file__).parent / "golden" / f"v{version}-plain", dataset)
    target = _outside(tmp_path) / "label"
    shutil.move(dataset / "label", target)
    os.symlink(target, dataset / "label")
    if version == "1.1":  # 1.1 checks the field documents when the dataset is opened
        with pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
            open_dataset(dataset)
    else:
        with open_dataset(dataset) as ds, pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
            ds.fields  # noqa: B018 - loading is the check


def test_field_directory_symlinked_to_etc_is_refused(dataset: Path) -> None:
    shutil.rmtree(dataset / "label")
    os.symlink("/etc", dataset / "label")
    with pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
        open_dataset(dataset)


def test_payload_directory_symlinked_outside_is_refused(dataset: Path, tmp_path: Path) -> None:
    target = _outside(tmp_path) / "image"
    shutil.move(dataset / "image", target)
    os.symlink(target, dataset / "image")
    with pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
        open_dataset(dataset)


def test_shard_file_symlinked_outside_is_refused(dataset: Path, tmp_path: Path) -> None:
    shard = dataset / "image" / "c" / "1" / "0" / "0" / "0"
    target = _outside(tmp_path) / "secret"
    shutil.move(shard, target)
    os.symlink(target, shard)
    with open_dataset(dataset) as ds:
        ds.payload.read([0])  # shard 0 is fine
        with pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
            ds.payload.read([12])
    report = verify(dataset, quick=True)
    assert [p.path.endswith("image/c/1/0/0/0") for p in report.problems] == [True]


def test_field_chunk_symlinked_outside_is_refused(dataset: Path, tmp_path: Path) -> None:
    chunk = dataset / "label" / "c" / "0"
    target = _outside(tmp_path) / "chunk"
    shutil.move(chunk, target)
    os.symlink(target, chunk)
    with open_dataset(dataset) as ds, pytest.raises(errors.UnsafePathError, match="outside the dataset directory"):
        ds.fields  # noqa: B018
    assert not verify(dataset, quick=True).ok


def test_symlinks_that_stay_inside_and_a_symlinked_root_are_fine(dataset: Path, tmp_path: Path) -> None:
    shard = dataset / "image" / "c" / "0" / "0" / "0" / "0"
    shutil.move(shard, dataset / "image" / "moved")
    os.symlink(dataset / "image" / "moved", shard)
    link = tmp_path / "link-to-ds"
    os.symlink(dataset, link)
    with open_dataset(link) as ds:
        np.testing.assert_array_equal(ds.payload.read([3]), make_records(25)[[3]])
        assert ds.fields["label"].shape == (25,)
    assert verify(link).ok


def test_writer_refuses_unsafe_names(tmp_path: Path) -> None:
    with pytest.raises(errors.UnsafePathError):
        DatasetWriter(tmp_path / "ds", kind="t", payload="image", record=FieldSpec((2,), "uint8"),
                      fields={"../label": FieldSpec((), "int64")})
