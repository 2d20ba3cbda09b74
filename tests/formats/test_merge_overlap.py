"""``merge`` refuses an output that is, contains or lies inside an input, however spelled (issue 31).

The check runs before ``--overwrite`` empties the output, so the input is left byte for byte as it was.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from shardkit.errors import ConversionError
from shardkit.formats.merge import merge
from shardkit.formats.outputs import refuse_overlap
from tests.helpers.cli import run_cli
from tests.helpers.datasets import make_records, write_dataset


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def two(tmp_path: Path) -> tuple[Path, Path]:
    a = write_dataset(tmp_path / "a", make_records(23, seed=1))
    b = write_dataset(tmp_path / "b", make_records(12, seed=2))
    return a, b


def _spellings(a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The input ``a`` (or a place inside it) spelled in every way a user might."""
    link = tmp_path / "link-to-a"
    link.symlink_to(a, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return [str(a), f"{a}/", "a", "./a/", f"{a}/../a", str(link), f"{link}/", f"file://{a}", str(a / "image"),
            str(a / "new" / "inside")]


def test_merge_refuses_an_output_that_is_or_is_inside_an_input(
    two: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two
    before = _snapshot(a)
    for spelled in _spellings(a, tmp_path, monkeypatch):
        with pytest.raises(ConversionError, match="is, contains or lies inside the input"):
            merge([a, b], spelled, overwrite=True)
        assert _snapshot(a) == before, spelled
    assert not (a / "new").exists()


def test_merge_refuses_an_output_that_contains_an_input(two: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two
    before = _snapshot(b)
    with pytest.raises(ConversionError, match="contains or lies inside"):
        merge([a, b], tmp_path, overwrite=True)
    assert _snapshot(b) == before


def test_merge_refuses_an_input_reached_through_a_symlinked_parent(two: tuple[Path, Path], tmp_path: Path) -> None:
    """A directory symlink in a parent (not the input itself) spells the input another way too."""
    a, b = two
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
    before = _snapshot(a)
    with pytest.raises(ConversionError, match="lies inside the input"):
        merge([a, b], tmp_path / "alias" / "a" / "", overwrite=True)
    assert _snapshot(a) == before


def test_cli_merge_into_an_input_with_overwrite_keeps_the_input(two: tuple[Path, Path]) -> None:
    a, b = two
    before = _snapshot(a)
    result = run_cli("merge", str(a), str(b), "-o", f"{a}/", "--overwrite")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    assert "lies inside the input" in result.stderr + result.stdout
    assert _snapshot(a) == before


def test_merge_into_a_sibling_still_works(two: tuple[Path, Path], tmp_path: Path) -> None:
    """A name that merely starts like an input (``a`` and ``ab``) is no overlap."""
    a, b = two
    report = merge([a, b], tmp_path / "ab")
    assert report.meta.num_records == 35


@pytest.mark.parametrize(("given", "out"), [
    ("s3://bucket/ds", "s3://bucket/ds/"),
    ("s3://bucket/ds", "s3a://BUCKET/ds"),
    ("s3://bucket/ds", "S3://bucket//ds/"),
    ("s3://bucket/ds", "s3://bucket/%64s"),
    ("s3://bucket/ds", "s3://bucket/ds/merged"),
    ("s3://bucket/ds/part", "s3://bucket/ds"),
    ("s3://bucket/ds", "s3://bucket"),
    ("gs://bucket/ds", "gcs://bucket/ds/"),
    ("az://container/ds", "azure://container/ds"),
])
def test_object_store_urls_spelled_differently_are_one_place(given: str, out: str) -> None:
    with pytest.raises(ConversionError, match="lies inside the input"):
        refuse_overlap([given], out, "merge")


@pytest.mark.parametrize(("given", "out"), [
    ("s3://bucket/ds", "s3://bucket/ds2"),
    ("s3://bucket/ds", "s3://other/ds"),
    ("s3://bucket/ds", "gs://bucket/ds"),
    ("s3://bucket/ds", "/tmp/ds"),
])
def test_distinct_places_pass(given: str, out: str) -> None:
    refuse_overlap([given], out, "merge")


def test_relative_output_is_resolved_against_the_working_directory(
    two: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = two
    monkeypatch.chdir(a / "image")
    with pytest.raises(ConversionError):
        refuse_overlap([a], os.path.join("..", "..", "a"), "merge")
